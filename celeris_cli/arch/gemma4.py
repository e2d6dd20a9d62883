"""Gemma 4's text layer as DiffusionGemma's code in transformers 5.23.0 computes it, to the same bits where it can.

RMSNorms that scale by their weight (not 1 + weight), computed in float32; attention with q/k norms, a scale-free
v norm and a softmax scale of 1; a full layer has its own head size and key/value heads, takes V from its K
projection (before the k norm), and rotates only the first `partial_rotary_factor` of its frequency pairs
(proportional RoPE); the dense MLP (GELU-tanh) runs *beside* a routed MoE (softmax router over a scale-free
RMSNorm of the input, top-k renormalised then scaled per expert), each normed, summed, normed again; the
residual sum is scaled by the pass's `layer_scalar`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .diffusion_gemma_config import DiffusionGemmaConfig, Rope

# A pass's attention mask for one layer type: a bool tensor (B, 1, T, keys), or, where nothing is hidden but
# the causal order, "all" (every key) or "causal" (as many keys as queries): transformers' own dispatch, kept
# so that a prompt without padding is computed with the same kernels, to the same bits
Mask = torch.Tensor | str
# A pass's attention for one layer type: one mask for the batch, or one a row (with a past a row: `Attention.forward`)
Masks = Mask | list[Mask]


def norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: in float32, times the weight (where it has one), cast back."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (out * weight.float() if weight is not None else out).type_as(x)


def rope_table(positions: torch.Tensor, dim: int, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, T, 1, dim) over a whole head: the first partial * dim / 2 pairs rotate at theta's
    frequencies (over the full head size, as proportional RoPE counts them), the rest have frequency 0."""
    turning = int(rope.partial * dim // 2)
    inv = 1.0 / (rope.theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.float32, device=positions.device) / dim))
    inv = torch.cat([inv, inv.new_zeros(dim // 2 - turning)]) / rope.factor
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1).float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, full: bool) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.dim = cfg.global_head_dim if full else cfg.head_dim
        self.kv_heads = cfg.global_kv_heads if full else cfg.num_key_value_heads
        self.full, self.eps = full, cfg.rms_norm_eps
        self.q_proj = nn.Linear(d, h * self.dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.dim, bias=False)
        if not full:  # a full layer's values are its keys' projection
            self.v_proj = nn.Linear(d, self.kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(h * self.dim, d, bias=False)
        self.q_norm = Norm(self.dim)
        self.k_norm = Norm(self.dim)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: Masks, past: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, d) over the cached (k, v) `past` (or None) -> (B, T, d) and the fresh (k, v). `mask`: a bool
        tensor (B, 1, T, keys), or "all" / "causal" where no key is hidden but the causal order's (see `Mask`).
        Or a list of B masks with `past` a list of B pasts: each row attends over its own past alone, as a
        batch of one would (the canvas running set's rows, each of its own length: no padding to mask)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.dim)
        k = self.k_proj(x).view(B, T, -1, self.dim)
        v = k if self.full else self.v_proj(x).view(B, T, -1, self.dim)
        q = rotate(norm(q, self.q_norm.weight, self.eps), *rope).transpose(1, 2)
        k = rotate(norm(k, self.k_norm.weight, self.eps), *rope).transpose(1, 2)
        v = norm(v, None, self.eps).transpose(1, 2)
        if isinstance(mask, list):
            pasts = past if past is not None else [None] * B
            rows = [self._attend(q[r : r + 1], k[r : r + 1], v[r : r + 1], mask[r], pasts[r]) for r in range(B)]
            y = torch.cat(rows)
        else:
            y = self._attend(q, k, v, mask, past)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, past: Any) -> torch.Tensor:
        """Attention of q (B, heads, T, dim) over the past keys and values (or None) and the fresh k, v."""
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if isinstance(mask, str):
            y = F.scaled_dot_product_attention(q, keys, values, scale=1.0, is_causal=mask == "causal", enable_gqa=True)
        else:  # transformers' SDPA path with a mask: the key/value heads repeated, not grouped
            rep = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)
        return y


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = cfg.top_k_experts, cfg.rms_norm_eps, cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, d) -> the top-k weights and experts (N, k): softmax in float32, renormalised, scaled per expert."""
        scores = self.proj(norm(x, None, self.eps) * self.scale * self.root)
        weights, experts = torch.topk(F.softmax(scores, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Experts(nn.Module):
    """The routed experts as two stacked tensors: gate and up fused (E, 2I, d), down (E, d, I)."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        E, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(E, d, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (N, d), each token's k experts and weights (N, k) -> (N, d). Computed as transformers' grouped experts
        compute it, so that it rounds the same: the (token, slot) pairs sorted by expert, one grouped matmul up
        and one down, weighted, back in order and summed over the k slots."""
        N, k = experts.shape
        order = torch.sort(experts.reshape(-1))
        rows = x[order.indices // k]
        counts = torch.bincount(order.values, minlength=self.num_experts)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        h = self.grouped(rows, "gate_up_proj", offsets)
        gate, up = h.chunk(2, dim=-1)
        y = self.grouped(F.gelu(gate, approximate="tanh") * up, "down_proj", offsets)
        y = y * weights.reshape(-1)[order.indices].unsqueeze(-1)
        back = torch.empty_like(order.indices)
        back[order.indices] = torch.arange(back.numel(), device=back.device)
        return y[back].view(N, k, -1).sum(1).to(x.dtype)

    @property
    def num_experts(self) -> int:
        return int(self.gate_up_proj.shape[0])

    def matrix(self, name: str, e: int) -> torch.Tensor:
        """Expert e's matrix of `name` (out, in) in the model's dtype."""
        w: torch.Tensor = getattr(self, name)[e]
        return w

    def grouped(self, x: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        """x (S, i) rows grouped by expert (`offsets`: where each expert's rows end) @ each expert's `name`.T
        -> (S, o): torch's grouped matmul on the CPU (transformers' path there; a GPU's takes bfloat16 only),
        otherwise one expert at a time."""
        stacked = getattr(self, name)
        grouped = getattr(F, "grouped_mm", None)
        exact = invariant.active()  # each expert's rows as `invariant.linear` computes them: whatever their count
        if not exact and grouped is not None and x.device.type == "cpu" and stacked.is_floating_point():
            return grouped(x.to(stacked.dtype), stacked.transpose(-2, -1), offs=offsets)
        out, start = None, 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                y = (
                    invariant.linear(x[start:end], self.matrix(name, e))
                    if exact
                    else x[start:end] @ self.matrix(name, e).t()
                )
                out = x.new_zeros(x.shape[0], y.shape[1], dtype=y.dtype) if out is None else out
                out[start:end] = y
            start = end
        assert out is not None, "a token's rows go to some expert"
        return out


class Layer(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, full: bool) -> None:
        super().__init__()
        d, self.eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, full)
        self.mlp = MLP(d, cfg.intermediate_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):  # fmt: skip
            setattr(self, name, Norm(d))
        self.register_buffer("layer_scalar", torch.ones(1))

    layer_scalar: torch.Tensor
    pre_feedforward_layernorm_2: Norm

    def forward(
        self, x: torch.Tensor, rope: Any, mask: Masks, past: Any, scalar: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        n, eps = self._norm, self.eps
        y, kv = self.self_attn(n(x, "input_layernorm"), rope, mask, past)
        x = x + n(y, "post_attention_layernorm")
        dense = n(self.mlp(n(x, "pre_feedforward_layernorm")), "post_feedforward_layernorm_1")
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.router(flat)
        routed = self.experts(norm(flat, self.pre_feedforward_layernorm_2.weight, eps), weights, experts)
        moe = n(routed.reshape(x.shape), "post_feedforward_layernorm_2")
        return (x + n(dense + moe, "post_feedforward_layernorm")) * scalar, kv

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return norm(x, getattr(self, name).weight, self.eps)
