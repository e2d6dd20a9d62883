"""Dream (Dream-v0-7B, Dream-Coder): a bidirectional transformer in Qwen2's layout whose logits are shifted.

Layout as Dream's `modeling_dream.py` saves it: `model.embed_tokens`, `model.layers.{i}.self_attn.{q,k,v}_proj`
(with bias) and `o_proj` (no bias), `mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`,
`model.norm`, `lm_head`; GQA and RoPE (rotate-half). Dream was initialised from an autoregressive Qwen2.5 and
keeps its habit: the logits at position j-1 predict position j (`logit_shift = 1`; the decoders' model
boundary applies it, as Dream's `diffusion_generate` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from .layers import KV, MLP, DiffusionLM, LayerKV, Weight, apply_rope, attend, check_special_ids, read_fields, rms_norm


@dataclass(frozen=True)
class DreamConfig:
    """Dream's config.json keys (Qwen2's names), with its special ids."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    mask_token_id: int
    eos_token_id: int
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eot_token_id: int | None = None  # not in Dream's config; the tokenizer's <|im_end|> is found instead
    model_type: str = "Dream"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.kv_heads:
            raise ModelError(
                f"config.json: hidden_size {self.hidden_size}, num_attention_heads {self.num_attention_heads} and "
                f"num_key_value_heads {self.kv_heads} do not divide evenly"
            )
        check_special_ids(self)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rows(self) -> int:
        return self.vocab_size

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DreamConfig:
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        for key in ("rope_scaling", "use_sliding_window"):
            if raw.get(key):
                raise ModelError(f"config.json: {key}={raw[key]!r} is not supported")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        return cls(**read_fields(cls, raw, required + ("mask_token_id", "eos_token_id")))


class DreamLayer(nn.Module):
    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.self_attn = _Attention(d, cfg.num_attention_heads * hd, cfg.kv_heads * hd)
        self.mlp = MLP(d, cfg.intermediate_size)
        self.input_layernorm = Weight(d)
        self.post_attention_layernorm = Weight(d)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None,
        cache: LayerKV | None,
        start: int | torch.Tensor,
        upcast: bool,
    ) -> tuple[torch.Tensor, KV]:
        B, T, _ = x.shape
        cfg, a, m = self.cfg, self.self_attn, self.mlp
        h = rms_norm(x, self.input_layernorm.weight, cfg.rms_norm_eps)
        q = a.q_proj(h).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y, kv = attend(q, k, v, attn_mask, cache, start, upcast)
        x = x + a.o_proj(y)
        h = rms_norm(x, self.post_attention_layernorm.weight, cfg.rms_norm_eps)
        return x + m(h), kv


class _Attention(nn.Module):
    def __init__(self, d: int, q_dim: int, kv_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, q_dim, bias=True)
        self.k_proj = nn.Linear(d, kv_dim, bias=True)
        self.v_proj = nn.Linear(d, kv_dim, bias=True)
        self.o_proj = nn.Linear(q_dim, d, bias=False)


class _Backbone(nn.Module):
    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DreamLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Weight(cfg.hidden_size)


class DreamModel(DiffusionLM):
    logit_shift = 1

    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, Any]:
        cfg = self.cfg
        return (
            self.model.embed_tokens,
            self.model.layers,
            lambda x: rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps),
        )

    def head_layer(self) -> nn.Module:
        return self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def rope_dims(self) -> tuple[int, float]:
        return self.cfg.head_dim, self.cfg.rope_theta


CONFIG = DreamConfig
MODEL = DreamModel
