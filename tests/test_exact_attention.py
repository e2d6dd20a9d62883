"""`arch.exact.attention`: a query's result is a function of the query and the keys it sees alone (not of the
other queries, the keys past its own, its row's batch mates or where its keys sit), and it is attention: a
softmax computed here, by hand, agrees with it."""

from __future__ import annotations

import math

import torch

from celeris_cli.arch.exact import attention


def _by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query (H, D) over its keys and values (H, n, D), in float64."""
    out = []
    for h in range(q.shape[0]):
        scores = [float(q[h].double() @ k[h, j].double()) / math.sqrt(q.shape[1]) for j in range(k.shape[1])]
        top = max(scores)
        z = [math.exp(s - top) for s in scores]
        out.append(sum(w / sum(z) * v[h, j].double() for j, w in enumerate(z)))
    return torch.stack(out)


def test_a_querys_result_is_its_own_whatever_the_shape_around_it() -> None:
    g = torch.Generator().manual_seed(0)
    H, D = 4, 16
    for s in (0, 5, 63, 64, 100):  # the query at position s sees keys 0..s
        k0, v0, q0 = (torch.randn(H, s + 1, D, generator=g), torch.randn(H, s + 1, D, generator=g),
                      torch.randn(H, D, generator=g))  # fmt: skip
        want = _by_hand(q0, k0, v0)
        results = []
        for T, B, row, lead, extra in (
            (1, 1, 0, 0, 0),
            (8, 3, 1, 0, 5),
            (20, 5, 4, 7, 70),
            (3, 2, 0, 2, 0),
            (90, 2, 1, 3, 0),
        ):
            L = lead + s + T + extra
            k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
            q = torch.randn(B, H, T, D, generator=g)
            k[row, :, lead : lead + s + 1], v[row, :, lead : lead + s + 1], q[row, :, 0] = k0, v0, q0
            key, col = torch.arange(L)[None, :], torch.arange(T)[:, None]
            mask = (key >= lead) & (key - lead - s <= col)  # causal from the row's first key, left padding before
            results.append(attention(q, k, v, mask[None, None].expand(B, 1, T, L))[row, :, 0])
        assert all(torch.equal(results[0], r) for r in results[1:]), s
        assert torch.allclose(results[0].double(), want, atol=1e-5)


def test_grouped_heads_and_a_query_that_sees_nothing() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k, v = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    mask = torch.ones(2, 1, 3, 10, dtype=torch.bool)
    mask[1, 0, 2] = False
    y = attention(q, k, v, mask)
    assert torch.equal(y[1, :, 2], torch.zeros(4, 8))
    want = _by_hand(q[0, :, 1], k[0].repeat_interleave(2, 0), v[0].repeat_interleave(2, 0))
    assert torch.allclose(y[0, :, 1].double(), want, atol=1e-5)


def test_keys_read_as_one_slice_or_gathered_row_by_row_give_the_same_bits() -> None:
    """Where every row's keys start at one place the window is a slice of the cache (padded with zeros past the
    last key); where rows start at different places each row's window is gathered. A query's bits are the same."""
    g = torch.Generator().manual_seed(2)
    B, H, D = 3, 4, 16
    for s, T in ((5, 1), (70, 1), (40, 6), (130, 3)):
        k0, v0 = torch.randn(H, s + T, D, generator=g), torch.randn(H, s + T, D, generator=g)
        q0 = torch.randn(H, T, D, generator=g)
        results = []
        for leads in ((0, 0, 0), (4, 4, 4), (0, 3, 9), (7, 0, 2)):
            L = max(leads) + s + T
            k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
            q = torch.randn(B, H, T, D, generator=g)
            key, col = torch.arange(L)[None, :], torch.arange(T)[:, None]
            masks = []
            for b, lead in enumerate(leads):  # row b's keys at lead.., its queries the last T, causal
                k[b, :, lead : lead + s + T], v[b, :, lead : lead + s + T] = k0, v0
                q[b] = q0
                masks.append((key >= lead) & (key - lead - s <= col) & (key < lead + s + T))
            y = attention(q, k, v, torch.stack(masks)[:, None])
            results.extend(y[b] for b in range(B))
        assert all(torch.equal(results[0], r) for r in results[1:]), (s, T)
