"""Attention whose result for a query is a function of that query, the keys it sees and nothing else: not of
the other queries in the forward, nor of how many keys lie past its own, nor of its row's batch mates.

Self-speculative decoding (`decode.selfspec`) computes the token at a position either in an AR step (one
query a row) or in a verify round (the row's seed, its draft and masks after them), and a row's place in the
cache depends on who is in its batch. SDPA picks its blocking by shape: the same query over the same keys
rounds differently with 1 query or 8, and with 100 keys or 105 of which 5 are masked (float32, CPU; on the
order of 1e-7), which moved a sampled token in about one answer in 1,500. Here every query is
computed in a shape that only the keys it sees decide:

- its span is [lo, hi), its first and one past its last seen key; the keys are read from lo in a window of
  `bucket(hi - lo)` positions (a multiple of `KEY_TILE`), the ones it does not see at -inf (exactly 0 after
  the softmax, which adds exactly nothing to the value sums);
- the queries of a row that share lo and a window are laid in tiles of `QUERY_TILE` rows (zero rows pad the
  last), so that the matmuls never take a kernel chosen by the number of queries (one query is a
  matrix-vector product, which rounds differently from a matrix product on this project's CPU);
- every tile of one window size is computed by one batched matmul, whose entries are independent products
  of the same shape.

So a query's numbers are the same in an AR step, in a verify round, in a prefill, at any place of the cache
and beside any rows. With the linear layers batch-invariant (`arch.invariant.linear`, rows padded to a
multiple of its tile) a position's hidden state, and so its token, cannot depend on the schedule.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import invariant

KEY_TILE = 64  # a query's keys are read in a window of a multiple of this many positions
QUERY_TILE = 16  # a window's queries are computed this many at a time (zero rows pad the last tile)

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("exact_attention", default=False)


_traced = False  # what `traced` pinned for a step torch.compile traces (it cannot read a ContextVar)
_planned: list[_Window] | None = None  # the windows `plan` worked out before a traced step


def active() -> bool:
    """Whether attention is computed query by query here (inside `enabled(True)`; inside a step being traced
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


def plan(mask: torch.Tensor | None, B: int, T: int, L: int, device: torch.device) -> None:
    """Work out a forward's windows before its step (`DiffusionLM.hidden`): they read the mask on the host,
    which a step traced whole may not; inside it `attention` takes these."""
    global _planned
    _planned = _windows(mask, B, T, L, device)


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Compute attention by `attention` inside this block (this thread or task only)."""
    token = _active.set(on)
    try:
        yield
    finally:
        _active.reset(token)


@contextlib.contextmanager
def exactly() -> Iterator[None]:
    """A position's numbers its own: batch-invariant linear layers (`arch.invariant`) and attention query by
    query (`attention`), so that how a position is computed (alone, in a verify round, beside any rows, at any
    place of the cache) cannot change its logits' bits, nor so a token (docs/determinism.md)."""
    with invariant.enabled(True), enabled(True):
        yield


def bucket(n: torch.Tensor) -> torch.Tensor:
    """The window (a multiple of KEY_TILE, at least one tile) a query seeing n keys reads."""
    return ((n + KEY_TILE - 1) // KEY_TILE).clamp_min(1) * KEY_TILE


@dataclass(frozen=True)
class _Window:
    """The queries of one window size in one forward: where each sits (b_of, t_of), its tile (group) and row
    in it (nth), each tile's row and key columns (gb, cols: G x w), and what each tile row may see."""

    b_of: torch.Tensor
    t_of: torch.Tensor
    group: torch.Tensor
    nth: torch.Tensor
    rows: int  # M: the tile's rows, a multiple of QUERY_TILE
    gb: torch.Tensor
    cols: torch.Tensor
    allowed: torch.Tensor  # (G, M, w) bool
    # where every row is one group, in order, and every group's window starts at one key: that key (its
    # keys are then a slice of the cache, no gather); None otherwise
    lo: int | None = None


_last: tuple[object, tuple[int, ...], list[_Window]] | None = None  # the last forward's: each layer's the same


def _windows(mask: torch.Tensor | None, B: int, T: int, L: int, device: torch.device) -> list[_Window]:
    """The queries' windows and tiles for this mask, worked out once per forward (every layer of one forward
    is given the same mask object)."""
    global _last
    shape = (B, T, L, mask._version if mask is not None else 0)  # a mask changed in place is another mask
    if _last is not None and mask is not None and _last[0] is mask and _last[1] == shape:
        return _last[2]
    seen = torch.ones(B, T, L, dtype=torch.bool, device=device) if mask is None else mask[:, 0].expand(B, T, L)
    anything = seen.any(-1)  # (B, T)
    lo = torch.where(anything, seen.int().argmax(-1), 0)
    hi = torch.where(anything, L - seen.flip(-1).int().argmax(-1), 0)
    window = bucket(hi - lo)
    out = []
    for w in window[anything].unique().tolist():
        b_of, t_of = (anything & (window == w)).nonzero(as_tuple=True)  # this window's queries, row-major
        key = b_of * (L + 1) + lo[b_of, t_of]  # the queries of one row from one lo share their keys
        groups, group = torch.unique_consecutive(key, return_inverse=True)
        first = torch.searchsorted(key, groups)  # each group's first query
        nth = torch.arange(len(key), device=device) - first[group]  # its place in its group
        M = int(nth.max()) // QUERY_TILE * QUERY_TILE + QUERY_TILE
        gb, glo = b_of[first], lo[b_of[first], t_of[first]]
        cols = glo[:, None] + torch.arange(w, device=device)[None, :]  # (G, w)
        inside = cols < L
        cols = cols.clamp_max(L - 1)  # a window past the keys reads the last one again, never seen (below)
        allowed = torch.ones(len(groups), M, w, dtype=torch.bool, device=device)  # padding rows: dropped
        own = seen[b_of, t_of][torch.arange(len(key), device=device)[:, None], cols[group]]
        allowed[group, nth] = own & inside[group]
        aligned = len(groups) == B and bool((gb == torch.arange(B, device=device)).all() & (glo == glo[0]).all())
        out.append(_Window(b_of, t_of, group, nth, M, gb, cols, allowed, int(glo[0]) if aligned else None))
    if mask is not None:
        _last = (mask, shape, out)
    return out


def _window_of(k: torch.Tensor, win: _Window) -> torch.Tensor:
    """Each group's window of `k` (B, Hkv, L, D) -> (G, Hkv, w, D), contiguous. Past the last key a window
    holds values no query sees (their scores are -inf, their weights exactly 0): the last key again, or where
    the window is a slice, zeros."""
    if win.lo is None:
        heads = torch.arange(k.shape[1], device=k.device)[None, :, None]
        return k[win.gb[:, None, None], heads, win.cols[:, None, :]]
    w = win.cols.shape[1]
    part = k[:, :, win.lo : win.lo + w]
    short = w - part.shape[2]
    return F.pad(part, (0, 0, 0, short)) if short else part.contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention, q (B, H, T, D) over k, v (B, Hkv, L, D), mask bool broadcastable to
    (B, 1, T, L) (True = may attend; the same for every head), each query computed as described above.
    A query that sees no key gets zeros. Returns (B, H, T, Dv) in q's dtype, computed in k's dtype."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    y = q.new_zeros(B, H, T, v.shape[-1])
    scale = 1.0 / math.sqrt(D)
    planned = _planned if torch.compiler.is_compiling() else None
    for win in planned if planned is not None else _windows(mask, B, T, k.shape[2], q.device):
        G = win.cols.shape[0]
        ks, vs = _window_of(k, win), _window_of(v, win)
        if Hkv != H:
            ks, vs = ks.repeat_interleave(H // Hkv, 1), vs.repeat_interleave(H // Hkv, 1)
        qs = q.new_zeros(G, H, win.rows, D, dtype=k.dtype)
        qs[win.group, :, win.nth] = q[win.b_of, :, win.t_of].to(k.dtype)
        scores = torch.matmul(qs.flatten(0, 1), ks.flatten(0, 1).transpose(1, 2)).unflatten(0, (G, H))
        # the softmax of the queries' own rows only (each row's is its own: the tile's padding rows stay zero)
        real = scores[win.group, :, win.nth]  # (N, H, w)
        real = (real * scale).masked_fill(~win.allowed[win.group, win.nth][:, None], float("-inf"))
        probs = scores.new_zeros(scores.shape)
        probs[win.group, :, win.nth] = real.softmax(-1)
        out = torch.matmul(probs.flatten(0, 1), vs.flatten(0, 1)).unflatten(0, (G, H))
        y[win.b_of, :, win.t_of] = out[win.group, :, win.nth].to(y.dtype)
    return y
