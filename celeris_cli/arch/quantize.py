"""Weight-only quantization (int8, int4), applied while a checkpoint loads.

- **int8**: every linear layer and the embedding (so a tied LM head too) keeps its weight as int8 with one
  float32 scale per output row (symmetric, per channel: scale = max|w| / 127). The matmul is torch's own
  weight-only int8 kernel (`torch._weight_int8pack_mm`).
- **int4**: grouped and asymmetric along the input: each run of `group` weights of an output row (128, 64
  or 32, the largest that divides the row) keeps a scale and a zero, w = (q - 8) x scale + zero with q in
  0..15 (the layout of torch's own int4 kernels, "tinygemm"). Linear layers hold torch's packed layout for
  their device (`_convert_weight_to_int4pack_for_cpu` / `_convert_weight_to_int4pack` on CUDA) and multiply
  with its kernel (`_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm`); an LM head of its own runs the
  kernel too (`DiffusionLM.head`). The embedding stays int8 (a lookup reads rows, and a head tied to it
  reads it as a matrix), as does a linear layer whose rows do not divide into groups of 32.

The model is built on the meta device as usual; `prepare` swaps its linear layers and embeddings for
quantized ones, and `convert` turns each full-precision tensor into its quantized form as it is read, one
tensor at a time, so the full-precision model never exists (the loader's peak is the quantized weights plus
one tensor). Activations stay in the model's dtype, and a row's result does not depend on the other rows
of the batch (`tests/test_quantize.py`). Reading `.weight` gives the dequantized matrix, so code that needs
the matrix itself (an LM head tied to the embedding) works unchanged, at the cost of a transient
full-precision copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .gemma4 import Experts
from .memory_sizes import QUANTIZE_CHOICES

SCALE = "weight_scale"


def check(scheme: str) -> str:
    if scheme not in QUANTIZE_CHOICES:
        raise UsageError(f"unknown quantization {scheme!r} (choose {', '.join(QUANTIZE_CHOICES)})")
    return scheme


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per row) of a 2-D weight."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class _Int8(nn.Module):
    """The int8 weight and its scales, saved and loaded under the float layer's names (`weight`, plus
    `weight_scale`), so a checkpoint's tensor names need no mapping."""

    qweight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.empty(rows, cols, dtype=torch.int8))
        self.register_buffer(SCALE, torch.empty(rows, dtype=torch.float32))
        self.register_buffer("bias", torch.empty(rows, dtype=dtype) if bias else None)
        self.dtype = dtype  # activations' dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix (a transient copy in the model's dtype)."""
        return self.qweight.to(torch.float32).mul_(self.weight_scale[:, None]).to(self.dtype)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.qweight
        destination[prefix + SCALE] = self.weight_scale
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        missing = args[3]
        names = (("weight", "qweight"), (SCALE, SCALE)) + ((("bias", "bias"),) if self.bias is not None else ())
        for key, attr in names:
            if prefix + key in state_dict:
                self._buffers[attr] = state_dict[prefix + key]
            else:
                missing.append(prefix + key)


class Int8Linear(_Int8):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch._weight_int8pack_mm(flat.contiguous(), self.qweight, self.weight_scale.to(x.dtype))
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int8Embedding(_Int8):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(torch.float32) * self.weight_scale[ids][..., None]
        return rows.to(self.dtype)


GROUPS = (128, 64, 32)  # int4 group sizes, the largest that divides a row is used


def group_of(cols: int) -> int | None:
    """The int4 group size for rows of `cols` weights; None: they do not divide into groups (int8 then)."""
    return next((g for g in GROUPS if cols % g == 0), None)


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q in 0..15 as int32 (rows, cols), scale and zero (rows, cols // group) in float32) of a 2-D weight:
    w ~ (q - 8) x scale + zero within each group of `group` columns (min and max of the group map to 0 and
    15)."""
    rows, cols = w.shape
    g = w.float().view(rows, cols // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(rows, cols)
    return q, scale, lo + 8 * scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 weights of `quantize_groups`'s (q, scale, zero); q may have leading dimensions."""
    groups = scale.shape[-1]
    g = q.float().view(*q.shape[:-1], groups, -1)
    return ((g - 8) * scale[..., None] + zero[..., None]).view(q.shape)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q in 0..15 (..., cols) -> two a byte (..., cols // 2): even columns in the high half (torch's order)."""
    return (q[..., ::2] << 4 | q[..., 1::2]).to(torch.uint8)


_PAD = 16  # torch's int4 packing wants the output rows in multiples of 16 (CPU) / 8 (CUDA)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(packed weight, scales and zeros (groups, rows, 2) in `dtype`) in torch's int4 kernel layout for q's
    device; rows padded to a multiple of 16 (padding rows multiply to zero and are cut from the output)."""
    rows, cols = q.shape
    pad = -rows % _PAD
    if pad:
        q = torch.cat([q, q.new_full((pad, cols), 8)])
        scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), sz
    tiles = 8 if cols % 128 == 0 else 4 if cols % 64 == 0 else 2
    return torch.ops.aten._convert_weight_to_int4pack(_nibbles(q).contiguous(), tiles), sz


class Int4Linear(nn.Module):
    """A linear layer with int4 grouped weights in torch's packed layout for its device (`pack_int4`),
    saved under the float layer's names (`weight`: the packed weight, `weight_scale`: scales and zeros)."""

    qweight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, rows: int, cols: int, group: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        padded = rows + -rows % _PAD
        self.register_buffer("qweight", torch.empty(padded, cols // 2, dtype=torch.uint8))
        self.register_buffer(SCALE, torch.empty(cols // group, padded, 2, dtype=dtype))
        self.register_buffer("bias", torch.empty(rows, dtype=dtype) if bias else None)
        self.rows, self.cols, self.group, self.dtype = rows, cols, group, dtype

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":  # activations in the model's dtype, or float32 (an upcast LM head)
            sz = self.weight_scale.to(x.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group, sz)
        # torch's CUDA kernel takes bfloat16 activations only
        sz = self.weight_scale.to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), self.qweight, self.group, sz).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y = self._mm(flat)[:, : self.rows].reshape(*x.shape[:-1], self.rows)
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix (a transient copy in the model's dtype): the kernel applied to the identity,
        a slice of it at a time (no code path reads it while decoding: the head runs the kernel)."""
        out = torch.empty(self.rows, self.cols, dtype=self.dtype, device=self.qweight.device)
        for lo in range(0, self.cols, 1024):
            hi = min(lo + 1024, self.cols)
            eye = torch.zeros(hi - lo, self.cols, dtype=self.dtype, device=self.qweight.device)
            eye[:, lo:hi].fill_diagonal_(1)
            out[:, lo:hi] = self._mm(eye)[:, : self.rows].t()
        return out

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        _Int8._save_to_state_dict(self, destination, prefix, keep_vars)  # type: ignore[arg-type]

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        _Int8._load_from_state_dict(self, state_dict, prefix, *args)  # type: ignore[arg-type]


Convert = Callable[[torch.Tensor], dict[str, torch.Tensor]]  # a weight -> its tensors, named by suffix


def _int8_of(t: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = quantize_rows(t)
    return {"weight": q, SCALE: scale}


def _int4_linear_of(group: int, dtype: torch.dtype) -> Convert:
    def convert(t: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, sz = pack_int4(*quantize_groups(t, group), dtype)
        return {"weight": packed, SCALE: sz}

    return convert


def prepare(model: nn.Module, dtype: torch.dtype, scheme: str = "int8") -> dict[str, Convert]:
    """Swap `model`'s linear layers and embeddings for quantized ones (in place; call it on the meta
    device); returns, for each weight to quantize, how its full-precision tensor becomes the new ones."""
    plan: dict[str, Convert] = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts):  # DiffusionGemma's stacked routed experts
                experts = QuantizedExperts(child, scheme, dtype)
                setattr(parent, name, experts)
                for n in EXPERTS:
                    plan[f"{parent_name}.{name}.{n}" if parent_name else f"{name}.{n}"] = experts.convert(n)
                continue
            if isinstance(child, nn.Linear):
                rows, cols, bias = child.out_features, child.in_features, child.bias is not None
            elif isinstance(child, nn.Embedding):
                rows, cols, bias = child.num_embeddings, child.embedding_dim, False
            else:
                continue
            group = group_of(cols) if scheme == "int4" and isinstance(child, nn.Linear) else None
            new: nn.Module
            if group is not None:
                new, how = Int4Linear(rows, cols, group, dtype, bias), _int4_linear_of(group, dtype)
            elif isinstance(child, nn.Linear):
                new, how = Int8Linear(rows, cols, dtype, bias), _int8_of
            else:
                new, how = Int8Embedding(rows, cols, dtype), _int8_of
            setattr(parent, name, new)
            plan[f"{parent_name}.{name}.weight" if parent_name else f"{name}.weight"] = how
    return plan


def converter(
    model: nn.Module, scheme: str, dtype: torch.dtype
) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """For the loader: after `prepare`, a function from one read tensor to the tensors it becomes."""
    plan = prepare(model, dtype, scheme) if check(scheme) != "none" else {}

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        how = plan.get(name)
        if how is None:
            return {name: t}
        stem = name[: name.rindex(".") + 1]  # the module's prefix: its tensors are named by their own names
        return {stem + suffix: v for suffix, v in how(t).items()}

    return convert


EXPERTS = ("gate_up_proj", "down_proj")  # the stacked tensors of a mixture's routed experts (`gemma4.Experts`)


def _unnibble(p: torch.Tensor) -> torch.Tensor:
    """`_nibbles`' inverse: two 0..15 a byte (..., cols // 2) -> (..., cols), the high half first."""
    return torch.stack([p >> 4, p & 15], dim=-1).flatten(-2)


class QuantizedExperts(nn.Module):
    """Routed experts (`gemma4.Experts`) whose stacked tensors are kept quantized and dequantized one expert at a
    time as it runs: int8 (a float32 scale per expert row), or int4 grouped along each row's inputs (two weights
    a byte, a scale and a zero per group in the model's dtype; int8 for a tensor whose rows do not divide into
    groups of 32). Saved under the float names: `gate_up_proj`, `down_proj`, with `_scale` (and `_zero`)."""

    def __init__(self, experts: nn.Module, scheme: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.groups = dtype, {}
        self.full_params = 0  # the full-precision weights it stands for (the memory planner's shape)
        for name in EXPERTS:
            E, rows, cols = getattr(experts, name).shape
            self.full_params += E * rows * cols
            group = group_of(cols) if scheme == "int4" else None
            self.groups[name] = group
            if group is None:
                self.register_buffer(name, torch.empty(E, rows, cols, dtype=torch.int8))
                self.register_buffer(name + "_scale", torch.empty(E, rows, dtype=torch.float32))
            else:
                self.register_buffer(name, torch.empty(E, rows, cols // 2, dtype=torch.uint8))
                self.register_buffer(name + "_scale", torch.empty(E, rows, cols // group, dtype=dtype))
                self.register_buffer(name + "_zero", torch.empty(E, rows, cols // group, dtype=dtype))

    def convert(self, name: str) -> Convert:
        """How the loader turns the float stack (E, rows, cols) of `name` into this module's tensors."""
        group = self.groups[name]

        def convert(t: torch.Tensor) -> dict[str, torch.Tensor]:
            """One expert at a time, so that no float32 copy of the whole stack is made."""
            E, rows, cols = t.shape
            if group is None:
                q, scale = torch.empty(E, rows, cols, dtype=torch.int8, device=t.device), []
                for e in range(E):
                    q[e], s = quantize_rows(t[e])
                    scale.append(s)
                return {name: q, name + "_scale": torch.stack(scale)}
            packed = torch.empty(E, rows, cols // 2, dtype=torch.uint8, device=t.device)
            scales, zeros = [], []
            for e in range(E):
                q4, s, z = quantize_groups(t[e], group)
                packed[e] = _nibbles(q4)
                scales.append(s.to(self.dtype))
                zeros.append(z.to(self.dtype))
            return {name: packed, name + "_scale": torch.stack(scales), name + "_zero": torch.stack(zeros)}

        return convert

    def matrix(self, name: str, e: int) -> torch.Tensor:
        """Expert e's matrix of `name` (out, in), dequantized in the model's dtype."""
        q, scale = getattr(self, name)[e], getattr(self, name + "_scale")[e]
        if self.groups[name] is None:
            return (q.float().mul_(scale[:, None])).to(self.dtype)
        zero = getattr(self, name + "_zero")[e]
        return dequantize_groups(_unnibble(q), scale.float(), zero.float()).to(self.dtype)

    @property
    def num_experts(self) -> int:
        return int(getattr(self, EXPERTS[0]).shape[0])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return Experts.forward(self, x, weights, experts)  # type: ignore[arg-type]

    def grouped(self, x: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        return Experts.grouped(self, x, name, offsets)  # type: ignore[arg-type]
