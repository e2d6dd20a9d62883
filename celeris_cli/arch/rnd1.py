"""RND1 (Radical Numerics, RND1-30B-A3B): a bidirectional diffusion LM in Qwen3-MoE's layout (`RND1LM`,
`model_type` "rnd1"), converted from an autoregressive Qwen3-MoE and keeping its habit: position j-1's
logits predict position j (`logit_shift = 1`), as Dream's.

Its mask id is the tokenizer's length (151669 for Qwen3's tokenizer): an embedding row with no token
string, so config.json's `mask_token_id` is taken as it is, outside the tokenizer (`mask_outside_tokenizer`).
A config saying `is_causal: true` is refused. Its sampler keeps the canvas's last position as the pad
token (`<|endoftext|>`), so every answer ends in one: the pad is a stop token (`pad_stops`), and the text
ends at the first.
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelError
from .qwen3_model import Qwen3Config, Qwen3DiffusionLM


class RND1Config(Qwen3Config):
    mask_outside_tokenizer = True
    pad_stops = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RND1Config:
        if raw.get("is_causal"):
            raise ModelError("config.json: is_causal=true is not supported (RND1 attends both ways)")
        result: RND1Config = cls.read(raw, raw.get("model_type") or "rnd1", required=("eos_token_id", "mask_token_id"))
        return result


class RND1Model(Qwen3DiffusionLM):
    logit_shift = 1


CONFIG = RND1Config
MODEL = RND1Model
