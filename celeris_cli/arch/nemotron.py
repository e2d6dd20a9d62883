"""Nemotron-Labs-Diffusion (`NemotronLabsDiffusionModel`, `model_type` "nemotron_labs_diffusion"): one
network decoded two ways, left to right (its AR mode) or a block at a time by diffusion over a causal cache.

The backbone is Ministral-3's, saved under `encoder.`: `encoder.embed_tokens`, per layer
`self_attn.{q,k,v,o}_proj` (no biases, no q/k norm, grouped-query heads), the SwiGLU `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`; `encoder.norm`; the LM head is `diffusion_head`. Two things
set it apart from a Llama:

- YaRN rotary embeddings (`rope_parameters` / `rope_scaling`, `rope_type` "yarn"): the frequencies between
  `beta_fast` and `beta_slow` rotations over `original_max_position_embeddings` ramp from extrapolated to
  interpolated by `factor`, and cos/sin are scaled by the attention factor (mscale over mscale_all_dim).
- Llama-4 query scaling after RoPE: q *= 1 + beta * log(1 + floor(position / original_max_position_embeddings)),
  beta = `llama_4_scaling_beta`, by each row's own position (left padding does not shift it).

Attention is what the decoder's mask says (`decode.nemotron`): causal for the AR mode, the prompt's prefill
and each block's commit pass; bidirectional inside a block being denoised. No logit shift: in the diffusion
mode position j's logits predict position j (the AR mode reads position j-1's, as any causal LM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from .layers import KV, MLP, DiffusionLM, LayerKV, LlamaShape, apply_rope, attend, read_fields, rms_norm
from .qwen3 import AttentionShape, Backbone, Layer

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# keys whose values would change the computation in a way this code does not follow, refused unless so
_PLAIN = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "sliding_window": None}
_YARN_KEYS = {
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "llama_4_scaling_beta",
    "attention_factor",
    "truncate",
}


@dataclass(frozen=True)
class Yarn:
    """YaRN's settings and Llama-4's query scale, as `rope_parameters` gives them."""

    theta: float
    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    llama_4_scaling_beta: float = 0.0

    @classmethod
    def read(cls, rope: dict[str, Any], max_positions: int) -> Yarn:
        unknown = sorted(set(rope) - _YARN_KEYS)
        if unknown:
            raise ModelError(f"config.json: rope_parameters keys {unknown} are not supported")
        if rope.get("rope_type") != "yarn":
            raise ModelError(f"config.json: rope_type {rope.get('rope_type')!r} is not supported (only 'yarn')")
        original = rope.get("original_max_position_embeddings") or max_positions
        # transformers' rule: with an original length given, the factor is the ratio of the two lengths
        factor = max_positions / original if "original_max_position_embeddings" in rope else rope.get("factor")
        if not isinstance(factor, (int, float)) or factor < 1:
            raise ModelError(f"config.json: the YaRN factor must be a number >= 1, got {factor!r}")
        return cls(
            theta=float(rope.get("rope_theta", 10000.0)),
            factor=float(factor),
            original_max=int(original),
            beta_fast=float(rope.get("beta_fast", 32.0)),
            beta_slow=float(rope.get("beta_slow", 1.0)),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)),
            llama_4_scaling_beta=float(rope.get("llama_4_scaling_beta", 0.0)),
        )

    def scale(self) -> float:
        """The attention factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(m: float = 1.0) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.mscale) / mscale(self.mscale_all_dim)
        return mscale()

    def inv_freq(self, dim: int, device: torch.device) -> torch.Tensor:
        """Per pair of dims: extrapolated (the plain frequency) above beta_fast rotations over the original
        length, interpolated (divided by the factor) below beta_slow, a linear ramp between."""

        def correction(rotations: float) -> float:
            return (dim * math.log(self.original_max / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        base = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        extrapolate = 1 - ramp
        return (1.0 / (self.factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) positions -> (B, 1, T, 1), Llama-4's per-position query factor."""
        scale = 1 + self.llama_4_scaling_beta * torch.log1p(torch.floor(positions.float() / self.original_max))
        return scale[:, None, :, None]


@dataclass(frozen=True)
class NemotronConfig(LlamaShape):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    mask_token_id: int
    eos_token_id: int
    yarn: Yarn
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    block_size: int = 32
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eot_token_id: int | None = None
    model_type: str = "nemotron_labs_diffusion"

    def __post_init__(self) -> None:
        self.check_shape(REQUIRED + ("block_size",))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NemotronConfig:
        for key, plain in _PLAIN.items():
            if raw.get(key, plain) != plain:
                raise ModelError(f"config.json: {key}={raw[key]!r} is not supported (only {plain!r})")
        if raw.get("dlm_paradigm", "bidirectional") != "bidirectional":
            raise ModelError(
                f"config.json: dlm_paradigm {raw['dlm_paradigm']!r} is not supported (only 'bidirectional')"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling")
        if not isinstance(rope, dict):
            raise ModelError("config.json: rope_parameters (YaRN) is missing")
        fields = {k: v for k, v in raw.items() if k != "yarn"}
        kwargs = read_fields(cls, fields, REQUIRED + ("mask_token_id", "eos_token_id"))
        max_positions = kwargs.get("max_position_embeddings", 262144)
        return cls(**kwargs, yarn=Yarn.read(rope, max_positions))


class NemotronLayer(Layer):
    """A Llama layer whose queries are scaled by position after RoPE (`rope` carries the factor)."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None,
        cache: LayerKV | None,
        start: int | torch.Tensor,
        upcast: bool,
    ) -> tuple[torch.Tensor, KV]:
        a, eps = self.self_attn, self.self_attn.shape.eps
        cos, sin, q_scale = rope
        q, k, v = a.qkv(rms_norm(x, self.input_layernorm.weight, eps))
        q = (apply_rope(q, cos, sin).float() * q_scale).to(q.dtype)
        k = apply_rope(k, cos, sin)
        y, kv = attend(q, k, v, attn_mask, cache, start, upcast)
        x = x + a.o_proj(y)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm.weight, eps)), kv


class NemotronModel(DiffusionLM):
    def __init__(self, cfg: NemotronConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shape = AttentionShape(
            cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.dim, cfg.rms_norm_eps, qk_norm=False
        )
        layers = [
            NemotronLayer(shape, MLP(cfg.hidden_size, cfg.intermediate_size)) for _ in range(cfg.num_hidden_layers)
        ]
        self.encoder = Backbone(cfg.vocab_size, cfg.hidden_size, layers)  # type: ignore[arg-type]
        if not cfg.tie_word_embeddings:
            self.diffusion_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def optional_tensors(self) -> frozenset[str]:
        return frozenset({"diffusion_head.weight"}) if self.cfg.tie_word_embeddings else frozenset()

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, Any]:
        eps = self.cfg.rms_norm_eps
        return self.encoder.embed_tokens, self.encoder.layers, lambda x: rms_norm(x, self.encoder.norm.weight, eps)

    def head_layer(self) -> nn.Module:
        return self.encoder.embed_tokens if self.cfg.tie_word_embeddings else self.diffusion_head

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        yarn = self.cfg.yarn
        freqs = positions.float()[..., None] * yarn.inv_freq(self.cfg.dim, positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, dim)
        scale = yarn.scale()
        return emb.cos() * scale, emb.sin() * scale, yarn.query_scale(positions)


CONFIG = NemotronConfig
MODEL = NemotronModel
