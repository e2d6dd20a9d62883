"""CoDA (Salesforce, CoDA-1.7B): a bidirectional diffusion LM in Qwen3's layout (`CoDALanguageModel`,
`model_type` "CoDA") whose logits are shifted as Dream's: position j-1's logits predict position j.

Its code differs from a plain Qwen3 in three ways Celeris follows or refuses: the LM head is never tied to
the embedding, whatever `tie_word_embeddings` says (a saved folder always carries `lm_head.weight`); its
config.json names no eos id (the tokenizer's `eos_token` is used); and its generation_config.json is
hand-written and never read by its own `diffusion_generate` (its `alg: "original"` is not an algorithm that
code knows), so Celeris does not read it either (`Architecture.generation_config`). CoDA's forward ignores
the attention mask (padding is attended and shifts positions); Celeris masks padding, so a row decoded in a
batch gets the answer it gets alone.
"""

from __future__ import annotations

from typing import Any

from .qwen3_model import Qwen3Config, Qwen3DiffusionLM


class CoDAConfig(Qwen3Config):
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CoDAConfig:
        untied = {k: v for k, v in raw.items() if k != "tie_word_embeddings"}
        result: CoDAConfig = cls.read(untied, raw.get("model_type") or "CoDA", required=())
        return result


class CoDAModel(Qwen3DiffusionLM):
    logit_shift = 1


CONFIG = CoDAConfig
MODEL = CoDAModel
