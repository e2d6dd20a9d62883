"""Weight-only int8 quantization, applied while a checkpoint loads.

Every linear layer and the embedding (so a tied LM head too) keeps its weight as int8 with one float32
scale per output row (symmetric, per channel: scale = max|w| / 127). The model is built on the meta
device as usual; `prepare` swaps its linear layers and embeddings for int8 ones, and `convert` turns
each full-precision tensor into its int8 form as it is read, one tensor at a time, so the full-precision
model never exists (the loader's peak is the int8 weights plus one tensor).

The matmul is torch's own weight-only int8 kernel (`torch._weight_int8pack_mm`): activations stay in the
model's dtype, and a row's result does not depend on the other rows of the batch. Reading `.weight`
gives the dequantized matrix, so code that needs the matrix itself (an LM head tied to the embedding)
works unchanged, at the cost of a transient full-precision copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .memory import QUANTIZE_CHOICES

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
        return (self.qweight.to(torch.float32) * self.weight_scale[:, None]).to(self.dtype)

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


def prepare(model: nn.Module, dtype: torch.dtype) -> set[str]:
    """Swap `model`'s linear layers and embeddings for int8 ones (in place; call it on the meta device);
    returns the names of the weights to quantize."""
    names = set()
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                new: _Int8 = Int8Linear(child.out_features, child.in_features, dtype, child.bias is not None)
            elif isinstance(child, nn.Embedding):
                new = Int8Embedding(child.num_embeddings, child.embedding_dim, dtype)
            else:
                continue
            setattr(parent, name, new)
            names.add(f"{parent_name}.{name}.weight" if parent_name else f"{name}.weight")
    return names


def converter(
    model: nn.Module, scheme: str, dtype: torch.dtype
) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """For the loader: after `prepare`, a function from one read tensor to the tensors it becomes."""
    quantized = prepare(model, dtype) if check(scheme) == "int8" else set()

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name not in quantized:
            return {name: t}
        q, scale = quantize_rows(t)
        return {name: q, name[: -len("weight")] + SCALE: scale}

    return convert
