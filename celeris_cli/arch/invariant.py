"""Batch-invariant computation: a row's numbers do not depend on the rows beside it.

A batch changes the shapes a row is computed in: left padding lengthens its keys, its batch mates add rows
to every matmul. Kernels pick their reduction order by shape (a matrix-vector path for one row, small-M
kernels for a few, vector lanes that a padded key lands in), so the same row rounds differently alone and
in a batch, and in low precision a near tie in a commit decision flips. Under `enabled(True)` the model
computes each row the same way whatever its company:

- every linear layer (each `nn.Linear`, the LM head, a router's gate) runs with its rows padded by zero rows to
  a multiple of `ROW_TILE`, so a call never takes the shape-dependent small-M paths, and each row's sums run
  in the order of the full-tile kernel whatever the number of rows;
- attention runs per group of rows with the same left padding, over exactly their own keys and queries
  (the padding sliced off), so a row's softmax and value sums see the shapes it has alone.

Norms, RoPE, the MoE's weighted sum and the decoders' softmax reduce along a row's own last dimension and
are invariant as they are. Thinking Machines' "Defeating Nondeterminism in LLM Inference" (2025) gives the
idea for autoregressive serving; this is its CPU form for a diffusion decoder.

A family gets this for free through `DiffusionLM`, which routes every plain `nn.Linear` of the model
through `linear` (`route_linears`, on its first forward) and computes its head and attention (`attend`)
here. A weight applied without an `nn.Linear` (a router's gate, a quantized layer's own class) must go
through `linear(x, weight, bias)`: it is `F.linear` while the mode is off.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROW_TILE = 16  # rows of every matmul are a multiple of this: the kernels' full-tile path, on every call

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_invariant", default=False)
# What a step being traced by torch.compile reads instead (dynamo cannot read a ContextVar, and a graph break
# in every linear layer would split each step into hundreds of graphs): a plain global, which dynamo guards on,
# so a step captured with the mode off is traced again, not reused, with it on. `traced` sets it from the
# caller's context, outside the traced region (`measure.graphs`).
_traced = False


def active() -> bool:
    """Whether the model computes batch-invariantly here (inside `enabled(True)`; inside a step being traced
    by torch.compile, what `traced` pinned for it)."""
    if torch.compiler.is_compiling():
        return _traced
    return _active.get()


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Run a compiled step inside this block: the mode it traces under is the caller's (`active()` here)."""
    global _traced
    before, _traced = _traced, _active.get()
    try:
        yield
    finally:
        _traced = before


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Decode with (or without) batch-invariant computation inside this block, in this thread/task only."""
    token = _active.set(on)
    try:
        yield
    finally:
        _active.reset(token)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with the rows (every dimension of x but the last) padded by zeros to a multiple of
    ROW_TILE where `active()`; the padding's outputs are dropped. x: (..., K), weight: (N, K) -> (..., N)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    extra = -rows % ROW_TILE
    if not extra or not active():
        return F.linear(x, weight, bias)
    flat = torch.cat((x.reshape(rows, K), x.new_zeros(extra, K)))
    return F.linear(flat, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` computed by `linear`: what `route_linears` makes of a model's plain linear layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def route_linears(model: nn.Module) -> None:
    """Every plain `nn.Linear` of `model` computes through `linear` from now on (its class becomes `Linear`:
    the same parameters, the same results while the mode is off). A layer of another class (a quantized
    linear) is left as it is and must call `linear` itself."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear


Span = tuple[tuple[int, ...] | None, int, int, int, bool]  # rows (None: all), keys [start, end), query offset, masked
_last_plan: tuple[object, object, tuple[int, ...], list[Span]] | None = None  # the previous layer's: same mask
_last_built: list[tuple[Any, torch.Tensor | None]] = []  # its rows and masks as tensors, for the eager layers


def plan(mask: torch.Tensor | None, start: int | torch.Tensor, B: int, T: int, L: int) -> list[Span]:
    """`attention`'s groups of rows for this mask, as plain numbers: the same for every layer of one forward
    (each is given the same mask and start objects), so worked out once per forward. It reads the mask on the
    host, so a forward works it out before its step (`DiffusionLM.hidden`); a step being traced by
    torch.compile takes the one worked out for it (a graph per plan: its numbers are the graph's constants)."""
    global _last_plan, _last_built
    key = (B, T, L)
    if torch.compiler.is_compiling():
        assert _last_plan is not None and _last_plan[2] == key, "the plan is worked out before the step"
        return _last_plan[3]
    if _last_plan is not None and _last_plan[0] is mask and _last_plan[1] is start and _last_plan[2] == key:
        return _last_plan[3]
    full = _full(mask, B, L)
    seen = full.reshape(B, -1, L).any(1)  # (B, L): keys some query of the row may attend to
    anything = seen.any(1)
    lead = torch.where(anything, seen.int().argmax(1), 0).tolist()  # leading keys no query sees
    last = torch.where(anything, L - seen.flip(1).int().argmax(1), L).tolist()  # one past the last seen key
    groups: dict[tuple[int, int], list[int]] = {}
    for b, span in enumerate(zip(lead, last)):
        groups.setdefault(span, []).append(b)
    spans: list[Span] = []
    built: list[tuple[Any, torch.Tensor | None]] = []
    for (off, end), rows in groups.items():
        q_off = max(0, off - start) if isinstance(start, int) else 0
        if q_off >= T:
            continue
        pick = tuple(rows) if len(rows) < B else None
        m = _group_mask(full, pick, off, end, q_off, T)
        masked = not bool(m.all())
        spans.append((pick, off, end, q_off, masked))
        built.append((slice(None) if pick is None else torch.tensor(pick, device=full.device), m if masked else None))
    _last_plan, _last_built = (mask, start, key, spans), built
    return spans


def _full(mask: torch.Tensor | None, B: int, L: int) -> torch.Tensor:
    full = torch.ones(1, 1, 1, L, dtype=torch.bool) if mask is None else mask
    return full.expand(B, *full.shape[1:])


def _group_mask(full: torch.Tensor, rows: Any, off: int, end: int, q_off: int, T: int) -> torch.Tensor:
    """A group's mask over its own keys and queries."""
    pick: Any = slice(None) if rows is None else torch.tensor(rows, device=full.device)
    m = full[pick][..., off:end]
    return m[:, :, q_off:] if m.shape[2] == T else m


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, start: int | torch.Tensor, gqa: bool
) -> torch.Tensor:
    """SDPA computed per group of rows that see the same span of keys, over exactly that span.

    q: (B, H, T, D) at canvas positions [start, start+T) (`start` one per row in the running set, whose rows
    are never left-padded); k, v: (B, Hkv, L, D); mask: bool, broadcastable to (B, H, T, L), True = may
    attend. A row's padding is its leading keys that no query may attend to (left padding), and its trailing
    ones (the running set's cache past the row's own block); both are sliced off, and so are the queries at
    leading padding positions (their output is zero: padding is never read). Each group's inputs are made
    contiguous and a mask that allows everything is dropped, as for the same row alone, so that both take
    one kernel path on one layout. Returns (B, H, T, D)."""
    B, H, T, _ = q.shape
    L = k.shape[2]
    y: torch.Tensor | None = None
    spans = plan(mask, start, B, T, L)
    built = None if torch.compiler.is_compiling() else _last_built  # a traced step makes its own from the mask
    full = None if mask is None else _full(mask, B, L)
    for i, (rows, off, end, q_off, masked) in enumerate(spans):
        pick: Any
        if built is not None:
            pick, m = built[i]
        else:
            pick = slice(None) if rows is None else torch.tensor(rows, device=q.device)
            m = _group_mask(full, rows, off, end, q_off, T) if masked and full is not None else None
        n = B if rows is None else len(rows)
        out = F.scaled_dot_product_attention(
            q[pick][:, :, q_off:].contiguous(),
            k[pick][:, :, off:end].contiguous(),
            v[pick][:, :, off:end].contiguous(),
            attn_mask=m,
            enable_gqa=gqa,
        )
        if n == B and q_off == 0:
            return out
        y = q.new_zeros(B, H, T, v.shape[-1]) if y is None else y
        y[pick, :, q_off:] = out
    return y if y is not None else q.new_zeros(B, H, T, v.shape[-1])
