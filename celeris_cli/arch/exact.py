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

import torch

from . import invariant

KEY_TILE = 64  # a query's keys are read in a window of a multiple of this many positions
QUERY_TILE = 16  # a window's queries are computed this many at a time (zero rows pad the last tile)

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("exact_attention", default=False)


def active() -> bool:
    """Whether attention is computed query by query here (inside `enabled(True)`)."""
    return _active.get()


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention, q (B, H, T, D) over k, v (B, Hkv, L, D), mask bool broadcastable to
    (B, 1, T, L) (True = may attend; the same for every head), each query computed as described above.
    A query that sees no key gets zeros. Returns (B, H, T, Dv) in q's dtype, computed in k's dtype."""
    B, H, T, D = q.shape
    L, Hkv = k.shape[2], k.shape[1]
    dev = q.device
    seen = torch.ones(B, T, L, dtype=torch.bool, device=dev) if mask is None else mask[:, 0].expand(B, T, L)
    anything = seen.any(-1)  # (B, T)
    lo = torch.where(anything, seen.int().argmax(-1), 0)
    hi = torch.where(anything, L - seen.flip(-1).int().argmax(-1), 0)
    window = bucket(hi - lo)
    y = q.new_zeros(B, H, T, v.shape[-1])
    kpad = torch.cat([k, k.new_zeros(B, Hkv, int(window.max()), D)], 2)  # every window inside the tensor
    vpad = torch.cat([v, v.new_zeros(B, Hkv, int(window.max()), v.shape[-1])], 2)
    mpad = torch.cat([seen, seen.new_zeros(B, T, int(window.max()))], 2)
    scale = 1.0 / math.sqrt(D)
    for w in window[anything].unique().tolist():
        b_of, t_of = (anything & (window == w)).nonzero(as_tuple=True)  # this window's queries, row-major
        key = b_of * (L + 1) + lo[b_of, t_of]  # the queries of one row from one lo share their keys
        groups, group = torch.unique_consecutive(key, return_inverse=True)
        G = len(groups)
        first = torch.searchsorted(key, groups)  # each group's first query
        nth = torch.arange(len(key), device=dev) - first[group]  # its place in its group
        M = int(nth.max()) // QUERY_TILE * QUERY_TILE + QUERY_TILE
        gb, glo = b_of[first], lo[b_of[first], t_of[first]]
        cols = glo[:, None] + torch.arange(w, device=dev)[None, :]  # (G, w)
        ks = kpad[gb[:, None], :, cols].transpose(1, 2)  # (G, Hkv, w, D)
        vs = vpad[gb[:, None], :, cols].transpose(1, 2)
        if Hkv != H:
            ks, vs = ks.repeat_interleave(H // Hkv, 1), vs.repeat_interleave(H // Hkv, 1)
        qs = q.new_zeros(G, H, M, D, dtype=k.dtype)
        qs[group, :, nth] = q[b_of, :, t_of].to(k.dtype)
        allowed = torch.ones(G, M, w, dtype=torch.bool, device=dev)  # padding queries: any keys, dropped
        allowed[group, nth] = mpad[b_of, t_of][torch.arange(len(key), device=dev)[:, None], cols[group]]
        scores = torch.matmul(qs.flatten(0, 1), ks.flatten(0, 1).transpose(1, 2)).unflatten(0, (G, H))
        scores = (scores * scale).masked_fill(~allowed[:, None], float("-inf"))
        out = torch.matmul(scores.softmax(-1).flatten(0, 1), vs.flatten(0, 1)).unflatten(0, (G, H))
        y[b_of, :, t_of] = out[group, :, nth].to(y.dtype)
    return y
