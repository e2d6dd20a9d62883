"""Packed forwards (`arch.packed`): rows laid end to end in one sequence give each row what its own forward
gives it, a fresh canvas or a window over its slot of a cache, and write its keys and values there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from celeris_cli import load_engine
from celeris_cli.arch.kv import KVCache
from celeris_cli.arch.packed import Segment, packed_layers


def _two_rows(tiny_model: Path, lengths: tuple[int, int], seed: int, slots: int, length: int) -> tuple[Any, ...]:
    """The model, two random rows of these lengths with their own forwards' hidden states and keys/values,
    and an empty cache of `slots` slots of `length` positions laid out for it."""
    model = load_engine(tiny_model, device="cpu", dtype="float32").model
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(10, 200, (1, n), generator=g) for n in lengths)
    with torch.no_grad():
        ha, kva = model.hidden(a, torch.arange(lengths[0])[None], None, None, 0, True)
        hb, kvb = model.hidden(b, torch.arange(lengths[1])[None], None, None, 0, True)
    k = kva[0][0]
    cache = KVCache.empty(len(kva), slots, k.shape[1], length, k.shape[3], k.dtype, torch.device("cpu"))
    return model, a, b, ha, hb, kva, kvb, cache


def test_rows_packed_end_to_end_get_what_their_own_forwards_give(tiny_model: Path) -> None:
    model, a, b, ha, hb, kva, kvb, cache = _two_rows(tiny_model, (11, 23), seed=0, slots=3, length=32)
    with torch.no_grad():
        # b's canvas fills slot 2 as it runs; a runs on its own fresh keys only
        segments = [Segment(0, 11), Segment(11, 34, cache, 2, 0, 23)]
        ids, pos = torch.cat([a, b], 1), torch.cat([torch.arange(11), torch.arange(23)])[None]
        h, _ = model.hidden(ids, pos, None, packed_layers(segments, len(kva)), 0, False)
        assert torch.allclose(h[0, :11], ha[0], atol=1e-5) and torch.allclose(h[0, 11:], hb[0], atol=1e-5)
        assert all(torch.allclose(c[2, :, :23], f[0], atol=1e-6) for (c, _), (f, _) in zip(cache.layers, kvb))

        # then b's last 5 positions again as a window over its slot (their keys rewritten at 18)
        window = b[:, 18:]
        step = [Segment(0, 5, cache, 2, 18, 23)]
        h2, _ = model.hidden(window, torch.arange(18, 23)[None], None, packed_layers(step, len(kva)), 0, False)
        assert torch.allclose(h2[0], hb[0, 18:], atol=1e-5)


def test_two_rows_over_one_cache_write_their_own_slots_and_nothing_else(tiny_model: Path) -> None:
    model, a, b, ha, hb, kva, kvb, cache = _two_rows(tiny_model, (9, 14), seed=1, slots=4, length=16)
    with torch.no_grad():
        segments = [Segment(0, 9, cache, 3, 0, 9), Segment(9, 23, cache, 1, 0, 14)]  # slots out of order
        ids, pos = torch.cat([a, b], 1), torch.cat([torch.arange(9), torch.arange(14)])[None]
        h, _ = model.hidden(ids, pos, None, packed_layers(segments, len(kva)), 0, False)
    assert torch.allclose(h[0, :9], ha[0], atol=1e-5) and torch.allclose(h[0, 9:], hb[0], atol=1e-5)
    for (ck, cv), (fa, _), (fb, _) in zip(cache.layers, kva, kvb):
        assert torch.allclose(ck[3, :, :9], fa[0], atol=1e-6) and torch.allclose(ck[1, :, :14], fb[0], atol=1e-6)
        assert not ck[0].any() and not ck[2].any() and not ck[3, :, 9:].any() and not ck[1, :, 14:].any()
        assert not cv[0].any() and not cv[2].any()


def test_rows_of_one_shape_share_an_attention_call_and_get_exactly_what_each_gets_apart(tiny_model: Path) -> None:
    """Three rows of one width over the same number of keys in consecutive slots are one attention call
    (`packed._groups`: one kernel launch on CUDA, not one per row); a fourth of another width is its own.
    Each row's hidden states are bit for bit those of the same packed forward run one row at a time."""
    from celeris_cli.arch import packed

    model = load_engine(tiny_model, device="cpu", dtype="float32").model
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(10, 200, (1, n), generator=g) for n in (8, 8, 8, 5)]
    kv = model.hidden(rows[0], torch.arange(8)[None], None, None, 0, True)[1]
    k = kv[0][0]

    def run(groups: list[list[int]]) -> torch.Tensor:
        cache = KVCache.empty(len(kv), 4, k.shape[1], 8, k.shape[3], k.dtype, torch.device("cpu"))
        out = []
        for members in groups:
            segments, at = [], 0
            for i in members:
                n = rows[i].shape[1]
                segments.append(Segment(at, at + n, cache, i, 0, n))
                at += n
            ids = torch.cat([rows[i] for i in members], 1)
            pos = torch.cat([torch.arange(rows[i].shape[1]) for i in members])[None]
            with torch.no_grad():
                out.append(model.hidden(ids, pos, None, packed_layers(segments, len(kv)), 0, False)[0][0])
        return torch.cat(out)

    together = [Segment(0, 8, None, 0), Segment(8, 16, None, 1), Segment(16, 24, None, 2), Segment(24, 29)]
    assert [len(grp) for grp in packed._groups(together)] == [3, 1]
    assert torch.equal(run([[0, 1, 2, 3]]), run([[0], [1], [2], [3]]))


def test_a_causal_segment_is_each_rows_causal_prefill(tiny_model: Path) -> None:
    """A causal prefill (`Segment.causal`, self-speculation's rows joining together): each row's queries over
    its keys up to their own, as its own forward under a causal mask, its keys written into its slot."""
    model, a, b, *_, cache = _two_rows(tiny_model, (7, 12), seed=2, slots=2, length=16)
    with torch.no_grad():
        alone = []
        for row in (a, b):
            n = row.shape[1]
            tril = torch.ones(1, 1, n, n, dtype=torch.bool).tril()
            alone.append(model.hidden(row, torch.arange(n)[None], tril, None, 0, True))
        segments = [Segment(0, 7, cache, 0, 0, 7, causal=True), Segment(7, 19, cache, 1, 0, 12, causal=True)]
        ids, pos = torch.cat([a, b], 1), torch.cat([torch.arange(7), torch.arange(12)])[None]
        h, _ = model.hidden(ids, pos, None, packed_layers(segments, len(cache.layers)), 0, False)
        bidirectional, _ = model.hidden(a, torch.arange(7)[None], None, None, 0, False)
    (ha, kva), (hb, kvb) = alone
    assert torch.allclose(h[0, :7], ha[0], atol=1e-5) and torch.allclose(h[0, 7:], hb[0], atol=1e-5)
    assert not torch.allclose(h[0, :6], bidirectional[0, :6], atol=1e-3)  # the mask mattered
    for (ck, _), (fa, _), (fb, _) in zip(cache.layers, kva, kvb):
        assert torch.allclose(ck[0, :, :7], fa[0], atol=1e-6) and torch.allclose(ck[1, :, :12], fb[0], atol=1e-6)
