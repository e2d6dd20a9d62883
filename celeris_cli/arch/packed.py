"""Packed forwards: the rows of a running set laid end to end in one sequence, so that one forward serves
rows of any width, each at its own place, with no padding.

A batched forward pads every row to the widest and every row to the furthest key; a running set whose rows
sit at different places and widths would split each round into several such forwards (one per shape) or pay
for the padding. Packed, the linear layers, norms and MLPs see one (1, N, d) input (they act on each
position alone), and attention runs per row (`Segment`): its queries over exactly its own keys, either its
own fresh ones or its slot of a lane's cache after its fresh keys and values are written there. So a row's
attention has the shapes it has alone, beside any others (SDPA's float32 result changes with the number of
keys even where the extra ones are masked).

A family gets this through `layers.attend`, which hands the attention to the `PackedLayer` a packed forward
gives each layer in place of its cache. RoPE and any per-position scaling read the positions the caller
gives, one per packed token (each row's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import exact
from .kv import DeferredKVCache, KVCache


@dataclass(frozen=True)
class Segment:
    """One row's tokens in a packed forward: positions [begin, end) of the packed sequence. With a `cache`,
    its fresh keys and values are written into slot `slot` at canvas positions [at, at + end - begin), and it
    attends over that slot's first `keys` positions; without one, over its own fresh keys only."""

    begin: int
    end: int
    cache: KVCache | None = None
    slot: int = 0
    at: int = 0
    keys: int = 0
    causal: bool = False  # each query over the keys up to its own (a causal prefill, or a window after `at` keys)
    block: int = 0  # block-causal in blocks of this width from the row's position 0 (no cache): query i sees key
    # j when j // block <= i // block (block diffusion's prefix, recomputed: `decode.running`)


class PackedLayer:
    """What one layer of a packed forward is given in place of its cache (`layers.attend` asks it)."""

    def __init__(self, plan: _Plan, layer: int, n_layers: int) -> None:
        self.plan = plan  # the forward's writes, groups and causal masks: one for all its layers
        self.layer = layer
        self.n_layers = n_layers

    @property
    def segments(self) -> list[Segment]:
        return self.plan.segments

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upcast: bool) -> torch.Tensor:
        """q (1, H, N, D), k and v (1, Hkv, N, D) -> (1, N, H * D), each segment's queries over its keys."""
        _, H, N, _ = q.shape
        gqa = H != k.shape[1]
        dtype = q.dtype
        up = dtype != torch.float32 and upcast  # low-precision rounding would depend on the shapes
        for w in self.plan.writes:  # every segment's fresh keys and values into its slot, one write per cache
            if isinstance(w.cache, DeferredKVCache) and not w.cache.layers:  # float32 under upcast, as attention
                w.cache.materialize(
                    self.n_layers, k.shape[1], k.shape[3], torch.float32 if upcast else k.dtype, k.device
                )
            ck, cv = w.cache.layers[self.layer]
            ck[w.slots, :, w.at] = k[0, :, w.tokens].transpose(0, 1).to(ck.dtype)
            cv[w.slots, :, w.at] = v[0, :, w.tokens].transpose(0, 1).to(cv.dtype)
        y = q.new_empty(1, H, N, v.shape[-1], dtype=torch.float32 if up else dtype)
        for group, seen in zip(self.plan.groups, self.plan.seen):  # one call per run of rows of one shape
            first, n = group[0], len(group)
            lo, hi, width = first.begin, group[-1].end, first.end - first.begin
            qs = q[0, :, lo:hi].unflatten(1, (n, width)).transpose(0, 1)  # (n, H, width, D)
            if first.cache is not None:
                ck, cv = first.cache.layers[self.layer]
                ks, vs = (
                    ck[first.slot : first.slot + n, :, : first.keys],
                    cv[first.slot : first.slot + n, :, : first.keys],
                )
            else:
                ks = k[0, :, lo:hi].unflatten(1, (n, width)).transpose(0, 1)
                vs = v[0, :, lo:hi].unflatten(1, (n, width)).transpose(0, 1)
            if up:
                qs, ks, vs = qs.float(), ks.float(), vs.float()
            if exact.active():  # each query's numbers its own (`arch.exact`)
                out = exact.attention(qs, ks, vs, seen[None, None])
            elif first.block or (first.causal and ks.shape[2] != width):  # block-causal; a causal window: bottom-right
                out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=first.causal, enable_gqa=gqa
                )  # (n, H, width, Dv)
            y[0, :, lo:hi] = out.transpose(0, 1).flatten(1, 2)
        return y.to(dtype).transpose(1, 2).reshape(1, N, -1)


def _groups(segments: list[Segment]) -> list[list[Segment]]:
    """The segments in runs that one attention call serves (on CUDA, one kernel launch instead of one per
    row): consecutive in the packed sequence, of one width, and over the same number of keys in consecutive
    slots of one cache (or each over its own fresh keys). A row's keys stay exactly its own."""
    groups: list[list[Segment]] = []
    for s in segments:
        if groups:
            last = groups[-1][-1]
            if (
                s.begin == last.end
                and s.end - s.begin == last.end - last.begin
                and s.cache is last.cache
                and s.causal == last.causal
                and s.block == last.block
                and (s.cache is None or (s.slot == last.slot + 1 and s.keys == last.keys))
            ):
                groups[-1].append(s)
                continue
        groups.append([s])
    return groups


@dataclass(frozen=True)
class _Writes:
    """Where the segments over one cache write their keys and values: packed token i goes to slot
    `slots[i]`, position `at[i]`."""

    cache: KVCache
    slots: torch.Tensor
    at: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    """What every layer of one packed forward shares, worked out once: the segments, where they write, their
    attention groups (`_groups`) and each group's query-by-key mask (bottom-right causal or all seen)."""

    segments: list[Segment]
    writes: list[_Writes]
    groups: list[list[Segment]]
    seen: list[torch.Tensor]


def packed_layers(segments: list[Segment], n_layers: int, device: torch.device | None = None) -> list[PackedLayer]:
    """The per-layer objects a packed forward passes as its cache (`device`: where its caches are, needed
    when one is a `DeferredKVCache` not yet written)."""
    by_cache: dict[int, tuple[KVCache, list[Segment]]] = {}
    for s in segments:
        if s.cache is not None:
            by_cache.setdefault(id(s.cache), (s.cache, []))[1].append(s)
    writes = []
    for cache, segs in by_cache.values():
        dev = device if device is not None else cache.layers[0][0].device
        slots = torch.cat([torch.full((s.end - s.begin,), s.slot, dtype=torch.long) for s in segs])
        at = torch.cat([torch.arange(s.at, s.at + s.end - s.begin) for s in segs])
        tokens = torch.cat([torch.arange(s.begin, s.end) for s in segs])
        writes.append(_Writes(cache, slots.to(dev), at.to(dev), tokens.to(dev)))
    groups = _groups(segments)
    seen = []
    for group in groups:
        first = group[0]
        width = first.end - first.begin
        keys = first.keys if first.cache is not None else width
        where = device if device is not None or first.cache is None else first.cache.layers[0][0].device
        ones = torch.ones(width, keys, dtype=torch.bool, device=where)
        if first.block:
            assert first.cache is None, "a block-causal segment attends over its own fresh keys"
            blocks = torch.arange(width, device=where) // first.block
            seen.append(blocks[None, :] <= blocks[:, None])
        else:
            seen.append(ones.tril(keys - width) if first.causal else ones)
    plan = _Plan(segments, writes, groups, seen)
    return [PackedLayer(plan, i, n_layers) for i in range(n_layers)]


def packed_hidden(
    net: Any, windows: list[torch.Tensor], blocks: list[int], n_layers: int, device: torch.device
) -> tuple[torch.Tensor, list[Segment]]:
    """One forward of `windows` (each a row's ids (L,) from its position 0, with no cache) laid end to end,
    each over exactly its own keys: both ways (blocks[i] 0), or block-causal in blocks of blocks[i]; windows of
    one shape side by side, so one attention call serves them. Returns the hidden states (N, d) and each
    window's segment, in the order given."""
    order = sorted(range(len(windows)), key=lambda i: (blocks[i], len(windows[i])))
    placed: dict[int, Segment] = {}
    begin = 0
    for i in order:
        placed[i] = Segment(begin, begin + len(windows[i]), block=blocks[i])
        begin = placed[i].end
    ids = torch.cat([windows[i] for i in order])
    pos = torch.cat([torch.arange(len(windows[i]), device=device) for i in order])
    layers = packed_layers([placed[i] for i in order], n_layers, device)
    h, _ = net.hidden(ids[None], pos[None], None, layers, 0, False)
    return h[0], [placed[i] for i in range(len(windows))]
