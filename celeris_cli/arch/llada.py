"""A bidirectional transformer in LLaDA's layout: RMSNorm, RoPE, SwiGLU, no causal mask.

The module knows tensors only. Parameter names follow LLaDA's checkpoints
(`model.transformer.blocks.{i}.q_proj.weight`, ...), so one class serves LLaDA-8B and our own models.

The forward pass is cache-ready: it can return each layer's keys and values, and it can attend to a
cached canvas of keys/values in which only a window of positions is recomputed (prefix and dual cache,
Fast-dLLM). With no cache it is a plain full-canvas forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .config_fields import check_type
from .layers import KV, DiffusionLM, LayerKV, apply_rope, attend, check_special_ids

# LLaDA config.json keys that change the architecture, and the only values we implement.
_UNSUPPORTED = {
    "alibi": False,
    "attention_layer_norm": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "rope": True,
    "block_type": "llama",  # OLMo's SwiGLU block with separate q/k/v (its "sequential" fuses them)
    "layer_norm_type": "rms",
    "multi_query_attention": False,  # n_kv_heads says how keys and values are shared
}


@dataclass(frozen=True)
class ModelConfig:
    """The subset of LLaDA's config.json that defines the network and its special tokens."""

    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden_size: int
    vocab_size: int
    mask_token_id: int
    eos_token_id: int
    n_kv_heads: int | None = None
    embedding_size: int | None = None
    max_sequence_length: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    weight_tying: bool = False
    pad_token_id: int | None = None
    eot_token_id: int | None = None  # end of turn for chat models; LLaDA's <|eot_id|>
    bos_token_id: int | None = None
    model_type: str = "llada"
    # Ours, not LLaDA's: attention causal between blocks (block diffusion, `celeris train --block-size`).
    block_causal: bool = False
    # Ours: trained jointly as a causal LM (`celeris train --ar-weight`): its committed text is written into
    # the cache causally, a clean position also predicts the next token (its AR mode), and diffusion fills a
    # block after a seed token (the layout of `decode.nemotron`).
    causal_context: bool = False

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ModelError(f"config.json: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ModelError(f"config.json: n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}")
        check_special_ids(self)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rows(self) -> int:
        """Rows of the embedding table (LLaDA pads it past vocab_size)."""
        return self.embedding_size or self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a LLaDA-style config.json. Keys we do not use are ignored; keys that would change the
        network in a way we do not implement are rejected by name."""
        for key, ok in _UNSUPPORTED.items():
            if key in raw and raw[key] not in (ok, None):
                raise ModelError(f"config.json: {key}={raw[key]!r} is not supported (only {ok!r})")
        if raw.get("activation_type", "silu") not in ("silu", "swiglu"):
            raise ModelError(f"config.json: activation_type {raw['activation_type']!r} is not supported")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        required = ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size", "mask_token_id", "eos_token_id")
        missing = [k for k in required if k not in kwargs]
        if missing:
            raise ModelError(f"config.json: missing required keys: {', '.join(missing)}")
        for f in fields(cls):
            if f.name in kwargs:
                check_type(f.name, kwargs[f.name], str(f.type))
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["n_kv_heads"] = self.kv_heads
        d["embedding_size"] = self.rows
        d["pad_token_id"] = self.pad_token_id if self.pad_token_id is not None else self.eos_token_id
        if not self.block_causal:  # a bidirectional model's config stays LLaDA's own
            del d["block_causal"]
        if not self.causal_context:  # nor does a block model trained without the AR mode
            del d["causal_context"]
        d.update(
            {
                "activation_type": "silu",
                "block_type": "llama",
                "include_bias": False,
                "layer_norm_type": "rms",
                "rope": True,
                "alibi": False,
            }
        )
        return d


class RMSNorm(nn.Module):
    """Computed in float32, as LLaDA does, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.attn_out = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)  # gate: silu(ff_proj h)
        self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None,
        cache: LayerKV | None,
        start: int | torch.Tensor,
        upcast: bool = True,
    ) -> tuple[torch.Tensor, KV]:
        B, T, _ = x.shape
        cfg = self.cfg
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y, new_kv = attend(q, k, v, attn_mask, cache, start, upcast)
        x = x + self.attn_out(y)
        h = self.ff_norm(x)
        x = x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))
        return x, new_kv


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.rows, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        if not cfg.weight_tying:
            self.ff_out = nn.Linear(cfg.d_model, cfg.rows, bias=False)


class LLaDAModel(DiffusionLM):
    """`model.transformer.*` naming, as in LLaDA's safetensors.

    The float32 upcast (`DiffusionLM.upcast`) cost about 5% of bfloat16 throughput on this CPU; not measured
    on a GPU, where float32 attention also gives up the fused bfloat16 kernels and the head's weight is
    cast per call (2 GB for LLaDA-8B)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.block_causal = cfg.block_causal
        self.model = nn.Module()
        self.model.transformer = Transformer(cfg)

    @property
    def transformer(self) -> Transformer:
        return self.model.transformer  # type: ignore[return-value]

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                # scaled init for the residual projections (GPT-2 / nanoGPT)
                s = (
                    std / math.sqrt(2 * self.cfg.n_layers)
                    if name.endswith(("attn_out.weight", "ff_out.weight")) and "blocks" in name
                    else std
                )
                with torch.no_grad():
                    p.normal_(0.0, s, generator=generator)

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, Any]:
        t = self.transformer
        return t.wte, t.blocks, t.ln_f

    def head_layer(self) -> nn.Module:
        t = self.transformer
        return t.wte if self.cfg.weight_tying else t.ff_out

    def rope_dims(self) -> tuple[int, float]:
        return self.cfg.head_dim, self.cfg.rope_theta


CONFIG = ModelConfig
MODEL = LLaDAModel
