"""LLaDA2.0 (mini, flash): a mixture-of-experts block-diffusion LM (`model_type` "llada2_moe").

Layout as its `modeling_llada2_moe.py` saves it: `model.word_embeddings`; per layer a fused
`attention.query_key_value` (q heads, then k heads, then v heads), RMSNorm on q and k per head
(`query_layernorm`, `key_layernorm`), rotary embedding on the first `partial_rotary_factor` of each head,
GQA and `attention.dense`; the first `first_k_dense_replace` layers have a dense SwiGLU MLP, the others a
mixture of experts; `model.norm` and `lm_head`.

The router (`mlp.gate`): sigmoid scores in float32; `expert_bias` is added only to *choose* experts; the
choice is group-limited (the `topk_group` groups whose two best biased scores sum highest, of `n_group`),
then the top `num_experts_per_tok`; the weights are the chosen unbiased scores, renormalised and scaled by
`routed_scaling_factor`. Shared experts always run. Every token gets its experts: no capacity, no dropping,
so a row's answer does not depend on its batch mates' routing.

Attention is block-causal (`block_causal`): a token sees its own block and every earlier one, which the
decoders express in the mask they pass (see `decode.block`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from . import invariant
from .layers import KV, MLP, DiffusionLM, LayerKV, Weight, apply_rope, attend, check_special_ids, read_fields, rms_norm


@dataclass(frozen=True)
class LLaDA2Config:
    """LLaDA2's config.json keys, with its special ids."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    eos_token_id: int | None = None  # released configs name none: the tokenizer's eos_token
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 600000.0
    rms_norm_eps: float = 1e-6
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = False
    first_k_dense_replace: int = 0
    num_experts: int | None = None
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int | None = None
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    mask_token_id: int | None = None  # the tokenizer's <|mask|> when absent
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eot_token_id: int | None = None  # the tokenizer's <|role_end|> is found instead
    model_type: str = "llada2_moe"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.kv_heads:
            raise ModelError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.kv_heads}"
            )
        if self.rot_dim % 2 or not 0 < self.rot_dim <= self.dim:
            raise ModelError(
                f"config.json: partial_rotary_factor {self.partial_rotary_factor} gives no even rotary dimension"
            )
        if self.num_experts:
            if self.num_experts % self.n_group or self.topk_group > self.n_group:
                raise ModelError(
                    f"config.json: {self.num_experts} experts cannot form n_group {self.n_group} groups "
                    f"with topk_group {self.topk_group}"
                )
            if self.num_experts_per_tok > self.num_experts // self.n_group * self.topk_group:
                raise ModelError("config.json: num_experts_per_tok exceeds the experts of the chosen groups")
        check_special_ids(self)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rot_dim(self) -> int:
        return int(self.dim * self.partial_rotary_factor)

    @property
    def rows(self) -> int:
        return self.vocab_size

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LLaDA2Config:
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        if raw.get("score_function", "sigmoid") != "sigmoid":
            raise ModelError(f"config.json: score_function {raw['score_function']!r} is not supported (only sigmoid)")
        for key in ("rope_scaling", "use_sliding_window", "norm_head"):
            if raw.get(key):
                raise ModelError(f"config.json: {key}={raw[key]!r} is not supported")
        # what the released code does and this one implements: renormalised top-k weights, RMSNorm, a sigmoid
        # router (norm_softmax off); another value would change the network
        for key, plain in (("norm_topk_prob", True), ("use_rmsnorm", True), ("norm_softmax", False)):
            if raw.get(key, plain) not in (plain, None):
                raise ModelError(f"config.json: {key}={raw[key]!r} is not supported (only {plain!r})")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        cfg = cls(**read_fields(cls, raw, required))
        if raw.get("rotary_dim") not in (None, cfg.rot_dim):
            raise ModelError(
                f"config.json: rotary_dim {raw['rotary_dim']} disagrees with head_dim x partial_rotary_factor "
                f"({cfg.rot_dim})"
            )
        return cfg


class Gate(nn.Module):
    expert_bias: torch.Tensor

    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        assert cfg.num_experts
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (N, d) -> the chosen experts (N, k) and their weights (N, k), float32."""
        cfg, N = self.cfg, x.shape[0]
        scores = torch.sigmoid(invariant.linear(x.float(), self.weight.float()))  # (N, E)
        biased = scores + self.expert_bias.float()
        groups = biased.view(N, cfg.n_group, -1)
        group_score = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)  # (N, n_group)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        allowed = keep[:, :, None].expand_as(groups).reshape(N, -1)
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, chosen)
        if cfg.num_experts_per_tok > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * cfg.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        assert cfg.num_experts
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.gate = Gate(cfg)
        self.shared_experts: MLP | None = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        chosen, weights = self.gate(flat)  # (N, k) each
        picked = flat.new_empty(*chosen.shape, d)  # (N, k, d): each token's experts' outputs, in choice order
        for e in chosen.unique().tolist():  # each expert runs once, on the tokens that chose it
            token, slot = (chosen == e).nonzero(as_tuple=True)
            picked[token, slot] = self.experts[e](flat[token])
        y = (picked.float() * weights[..., None]).sum(1).to(x.dtype).view(B, T, d)
        return y + self.shared_experts(x) if self.shared_experts is not None else y


class Attention(nn.Module):
    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        H, Hkv, D = cfg.num_attention_heads, cfg.kv_heads, cfg.dim
        self.query_key_value = nn.Linear(cfg.hidden_size, (H + 2 * Hkv) * D, bias=cfg.use_qkv_bias)
        if cfg.use_qk_norm:
            self.query_layernorm = Weight(D)
            self.key_layernorm = Weight(D)
        self.dense = nn.Linear(H * D, cfg.hidden_size, bias=cfg.use_bias)


class Layer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.attention = Attention(cfg)
        self.mlp: nn.Module = MoE(cfg) if cfg.is_moe(index) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = Weight(cfg.hidden_size)
        self.post_attention_layernorm = Weight(cfg.hidden_size)

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
        cfg, a = self.cfg, self.attention
        H, Hkv, eps = cfg.num_attention_heads, cfg.kv_heads, cfg.rms_norm_eps
        h = rms_norm(x, self.input_layernorm.weight, eps)
        q, k, v = a.query_key_value(h).view(B, T, H + 2 * Hkv, cfg.dim).split([H, Hkv, Hkv], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cfg.use_qk_norm:
            q, k = rms_norm(q, a.query_layernorm.weight, eps), rms_norm(k, a.key_layernorm.weight, eps)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y, kv = attend(q, k, v, attn_mask, cache, start, upcast)
        x = x + a.dense(y)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm.weight, eps)), kv


class _Backbone(nn.Module):
    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Weight(cfg.hidden_size)


class LLaDA2MoeModel(DiffusionLM):
    block_causal = True

    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, Any]:
        cfg = self.cfg
        return (
            self.model.word_embeddings,
            self.model.layers,
            lambda x: rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps),
        )

    def head_layer(self) -> nn.Module:
        return self.model.word_embeddings if self.cfg.tie_word_embeddings else self.lm_head

    def rope_dims(self) -> tuple[int, float]:
        return self.cfg.rot_dim, self.cfg.rope_theta


CONFIG = LLaDA2Config
MODEL = LLaDA2MoeModel
