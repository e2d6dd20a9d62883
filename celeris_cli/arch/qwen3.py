"""The Qwen3 / Qwen3-MoE / OLMoE pieces several diffusion families share: attention with an RMSNorm on each
head's query and key (`q_norm`, `k_norm`), the SwiGLU MLP, and the softmax-routed mixture of experts.

Names as `transformers` saves these layouts: per layer `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
`mlp.{gate,up,down}_proj` (dense) or `mlp.gate` (the router) and `mlp.experts.{e}.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`. The router (Qwen3-MoE, OLMoE): softmax over every expert in
float32, the top `k` chosen, their weights renormalised to sum to 1 where the config says so
(`norm_topk_prob`). Every token gets its experts (no capacity, no dropping), so a row's answer does not depend
on its batch mates' routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import KV, MLP, LayerKV, Weight, apply_rope, attend, rms_norm


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool
    expert_bias: bool = False  # OLMoE-style LLaDA-MoE: a bias added to the softmax scores before top-k


class SoftmaxMoE(nn.Module):
    """Softmax router over `num_experts` SwiGLU experts, top-k per token."""

    expert_bias: torch.Tensor | None

    def __init__(self, d: int, r: Routing) -> None:
        super().__init__()
        self.routing = r
        self.gate = nn.Linear(d, r.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(d, r.expert_size) for _ in range(r.num_experts))
        if r.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(r.num_experts))
        else:
            self.expert_bias = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (N, d) -> the chosen experts (N, k) and their weights (N, k), float32."""
        scores = F.softmax(self.gate(x).float(), dim=-1)
        if self.expert_bias is not None:  # LLaDA-MoE adds it to the scores it then weighs with
            scores = scores + self.expert_bias.float()
        weights, chosen = scores.topk(self.routing.top_k, dim=-1)
        if self.routing.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        chosen, weights = self.route(flat)  # (N, k) each
        picked = flat.new_zeros(*chosen.shape, d)  # (N, k, d): each token's experts' outputs, in choice order
        for e in chosen.unique().tolist():  # each expert runs once, on the tokens that chose it
            token, slot = (chosen == e).nonzero(as_tuple=True)
            picked[token, slot] = self.experts[e](flat[token])
        return (picked.float() * weights[..., None]).sum(1).to(x.dtype).view(B, T, d)


@dataclass(frozen=True)
class AttentionShape:
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    bias: bool = False  # q/k/v/o biases (`attention_bias`)
    qk_norm: bool = True
    clip_qkv: float | None = None  # OLMoE: q, k (after their norm) and v clamped to [-clip, clip]


class Attention(nn.Module):
    def __init__(self, s: AttentionShape) -> None:
        super().__init__()
        self.shape = s
        self.q_proj = nn.Linear(s.hidden_size, s.heads * s.head_dim, bias=s.bias)
        self.k_proj = nn.Linear(s.hidden_size, s.kv_heads * s.head_dim, bias=s.bias)
        self.v_proj = nn.Linear(s.hidden_size, s.kv_heads * s.head_dim, bias=s.bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden_size, bias=s.bias)
        if s.qk_norm:
            self.q_norm = Weight(s.head_dim)
            self.k_norm = Weight(s.head_dim)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, d) -> q (B, H, T, D), k and v (B, Hkv, T, D), each head's q and k normalised."""
        s, (B, T, _) = self.shape, h.shape
        q = self.q_proj(h).view(B, T, s.heads, s.head_dim)
        k = self.k_proj(h).view(B, T, s.kv_heads, s.head_dim)
        v = self.v_proj(h).view(B, T, s.kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = rms_norm(q, self.q_norm.weight, s.eps), rms_norm(k, self.k_norm.weight, s.eps)
        if s.clip_qkv is not None:  # after the norm, as OLMoE clips
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class Layer(nn.Module):
    """A pre-norm decoder layer: attention, then the MLP or the mixture of experts (and a shared expert
    where the family has one, added to the experts' output)."""

    def __init__(self, s: AttentionShape, mlp: nn.Module, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = mlp
        if shared_expert is not None:
            self.shared_expert = shared_expert
        self.input_layernorm = Weight(s.hidden_size)
        self.post_attention_layernorm = Weight(s.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None,
        cache: LayerKV | None,
        start: int | torch.Tensor,
        upcast: bool,
    ) -> tuple[torch.Tensor, KV]:
        a, eps = self.self_attn, self.self_attn.shape.eps
        q, k, v = a.qkv(rms_norm(x, self.input_layernorm.weight, eps))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y, kv = attend(q, k, v, attn_mask, cache, start, upcast)
        x = x + a.o_proj(y)
        h = rms_norm(x, self.post_attention_layernorm.weight, eps)
        out = self.mlp(h)
        if hasattr(self, "shared_expert"):
            out = out + self.shared_expert(h)
        return x + out, kv


class Backbone(nn.Module):
    """`model.embed_tokens`, `model.layers`, `model.norm`."""

    def __init__(self, vocab_size: int, d: int, layers: list[Layer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d)
        self.layers = nn.ModuleList(layers)
        self.norm = Weight(d)
