"""SDAR and TraDo (JetAstra/SDAR): block diffusion in Qwen3's layout (`SDARForCausalLM`) or Qwen3-MoE's
(`SDARMoeForCausalLM`), `model_type` "sdar" / "sdar_moe".

Attention is block-causal: a token sees its own block and every earlier one (block 4 in SDAR's own
`generate.py`), so committed blocks' keys and values are cached exactly; the block strategies express the
pattern in the mask they pass (`decode.block`). No logit shift: position j's logits predict position j.
SDAR's config.json names no mask id; the tokenizer's `<|MASK|>` is found instead (`arch.tokenizer`).
"""

from __future__ import annotations

from typing import Any

from .qwen3_model import Qwen3Config, Qwen3DiffusionLM


class SDARConfig(Qwen3Config):
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SDARConfig:
        result: SDARConfig = cls.read(raw, raw.get("model_type") or "sdar")
        return result


class SDARModel(Qwen3DiffusionLM):
    block_causal = True


CONFIG = SDARConfig
MODEL = SDARModel
