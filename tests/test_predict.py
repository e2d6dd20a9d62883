"""The lean prediction of the fast decoder: the same survivors, distribution and confidence as over the
whole vocabulary, and draws that depend on the row alone."""

from __future__ import annotations

import pytest
import torch

from celeris_cli.decode.predict import Places, candidates, confidence_masked, sample_masked
from celeris_cli.decode.sampling import ORDER, SAMPLE, Draws, _unit, stream_seed
from celeris_cli.params import Sampling

from .oracles import confidence_of, filtered_scores

CPU = torch.device("cpu")


def draws_for(*seeds: int) -> Draws:
    """One step's draws for rows of these seeds (block 0, step 0)."""
    return Draws([stream_seed(seed, 0, 0) for seed in seeds], CPU)


def at(counts: list[int]) -> Places:
    """Rows after rows, row b with counts[b] positions (numbered in it)."""
    return Places.counted(counts, CPU)


def sampling(**kw: float) -> Sampling:
    return Sampling(**{"temperature": 1.0, "min_p": 0.0, "top_p": 1.0, "top_k": 0, **kw})  # type: ignore[arg-type]


def logits_with_ties(n: int = 40, v: int = 300, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    logits[:, 10:20] = logits[:, 10:11]  # ties, some of them near the top
    logits[::3, 50:60] = logits[::3, :].amax(-1, keepdim=True)
    return logits


SETTINGS = [
    {"min_p": 0.08, "temperature": 1.2},
    {"min_p": 0.001},
    {"top_k": 5},
    {"top_k": 12},  # cuts through the tied group
    {"top_p": 0.9},
    {"top_p": 0.3, "top_k": 40},
    {"top_p": 0.999, "min_p": 0.01, "temperature": 0.7},
    {"top_k": 299},
]


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_candidates_keep_exactly_the_tokens_the_whole_vocabulary_filter_keeps(kw: dict) -> None:
    logits = logits_with_ties()
    s = sampling(**kw)
    full = filtered_scores(logits, s)
    ids, scores = candidates(logits, s)
    assert scores.dtype == torch.float64
    for n in range(logits.shape[0]):
        alive = scores[n] > float("-inf")
        kept = dict(zip(ids[n][alive].tolist(), scores[n][alive].tolist()))
        expected = {t: full[n, t].item() for t in torch.nonzero(full[n] > float("-inf")).flatten().tolist()}
        assert sorted(kept.values()) == sorted(expected.values())
        # a top-p cut inside a group of equal scores may keep any of them (the full sort is not stable
        # either); every token above the cut is the same
        cut = min(expected.values())
        assert {t for t, v in kept.items() if v > cut} == {t for t, v in expected.items() if v > cut}


def test_sampling_among_survivors_follows_the_tempered_distribution() -> None:
    base = torch.tensor([5.0, 4.0, 0.0, -1.0, 4.5] + [-20.0] * 200)
    logits = base.expand(4000, -1).clone()
    x0 = sample_masked(logits, sampling(min_p=0.2, temperature=1.0), at([1000] * 4), draws_for(0, 1, 2, 3))
    seen = torch.bincount(x0, minlength=5)[:5] / 4000
    kept = torch.tensor([5.0, 4.0, 4.5])  # e^-1 and e^-0.5 of the top: inside min-p 0.2; the rest is not
    p = kept.softmax(0)
    assert seen[2] == seen[3] == 0
    assert torch.allclose(seen[[0, 1, 4]], p, atol=0.03)


@pytest.mark.parametrize("kw", [{"min_p": 0.05}, {"top_p": 0.9}, {"top_k": 7}, {}], ids=str)
def test_a_rows_draws_do_not_depend_on_its_batch_mates(kw: dict) -> None:
    """Row 0 alone and row 0 next to a row with many more survivors (a flat distribution) draw alike."""
    s = sampling(**kw)
    sharp = logits_with_ties(6, 300, seed=1) * 3
    flat = torch.randn(9, 300, generator=torch.Generator().manual_seed(2)) * 0.01
    alone = sample_masked(sharp, s, at([6]), draws_for(7))
    together = sample_masked(torch.cat([sharp, flat]), s, at([6, 9]), draws_for(7, 8))
    assert torch.equal(alone, together[:6])
    assert len(set(together[6:].tolist())) > 1  # the flat row really samples


@pytest.mark.parametrize("kind", ["prob", "margin", "lead", "entropy"])
def test_confidence_matches_the_full_softmax_definition(kind: str) -> None:
    logits = logits_with_ties(30, 300, seed=3)
    x0 = sample_masked(logits, sampling(min_p=0.01), at([30]), draws_for(0))
    expected = confidence_of(logits[None], x0[None], kind)[0]  # type: ignore[arg-type]
    assert torch.allclose(confidence_masked(logits, x0, kind), expected, atol=1e-6)  # type: ignore[arg-type]


def test_temperature_zero_is_the_argmax() -> None:
    logits = logits_with_ties()
    assert torch.equal(sample_masked(logits, sampling(temperature=0.0), at([40]), draws_for()), logits.argmax(-1))


@pytest.mark.parametrize("kw", [*SETTINGS, {}], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "none")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampled_token_s_probability_is_that_of_the_filtered_distribution(kw: dict, temperature: float) -> None:
    """The block decoders' confidence, from the survivors alone, equals the whole-vocabulary filtered
    softmax at the token drawn (filters at temperature 1 when greedy), and the draw is sample_masked's.
    Without ties: where top-p cuts through tied tokens, the whole-vocabulary sort keeps an arbitrary subset."""
    from celeris_cli.decode.predict import sample_with_probability

    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(0)) * 3
    s = sampling(**{**kw, "temperature": temperature})
    counts = at([10, 0, 30])
    x0, prob = sample_with_probability(logits, s, counts, draws_for(0, 1, 2))
    assert torch.equal(x0, sample_masked(logits, s, counts, draws_for(0, 1, 2)))
    full = filtered_scores(logits, sampling(**{**kw, "temperature": temperature or 1.0})).softmax(-1)
    assert torch.allclose(prob, full.gather(-1, x0[:, None]).squeeze(-1).float(), atol=1e-6)


def test_entropy_confidence_is_finite_where_tokens_are_banned() -> None:
    """min_tokens bans stop tokens with a logit of -inf; exp(-H) must treat their p log p as 0, not NaN."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g)
    banned = logits.clone()
    banned[:, 7] = float("-inf")
    x0 = torch.tensor([0, 1, 2])
    got = confidence_masked(banned, x0, "entropy")
    assert torch.isfinite(got).all()
    kept = torch.cat([logits[:, :7], logits[:, 8:]], 1)
    assert torch.allclose(got, confidence_masked(kept, x0, "entropy"))  # as if the token were not there


def _splitmix64_number(key: int, i: int, lane: int) -> int:
    """Number i of lane `lane` of a stream key, in plain Python integers: the counter-based noise's spec."""
    mask = 2**64 - 1
    z = (key + (lane * 2**56 + i + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_counter_noise_is_splitmix64_of_row_key_and_counter() -> None:
    """Every number is a pure function of (row key, lane, counter), computed in int64 tensors exactly as
    unsigned 64-bit arithmetic would: the top 52 bits (float64) or 23 (float32), plus half a step."""
    keys = [stream_seed(seed, 3, 5) for seed in (0, 1, 2**40 + 7)] + [2**63 - 1]
    draws = Draws(keys, CPU)
    u64 = draws.uniform((2, 3), torch.float64, ORDER)
    u32 = draws.uniform((6,), torch.float32, SAMPLE)
    at = draws.uniform_at(torch.tensor([3, 0]), torch.tensor([[0, 5], [2**32 + 1, 7]]), SAMPLE)
    for b, key in enumerate(keys):
        for i in range(6):
            assert u64[b].flatten()[i].item() == ((_splitmix64_number(key, i, ORDER) >> 12) + 0.5) * 2.0**-52
            assert u32[b, i].item() == ((_splitmix64_number(key, i, SAMPLE) >> 41) + 0.5) * 2.0**-23
    assert at[0, 1].item() == ((_splitmix64_number(keys[3], 5, SAMPLE) >> 12) + 0.5) * 2.0**-52
    for dtype in (torch.float64, torch.float32):  # the extreme bits stay inside (0, 1): no log of 0 or 1
        ends = _unit(torch.tensor([0, -1]), dtype)
        assert 0 < float(ends[0]) and float(ends[1]) < 1
    assert at[1, 0].item() == ((_splitmix64_number(keys[0], 2**32 + 1, SAMPLE) >> 12) + 0.5) * 2.0**-52


@pytest.mark.parametrize("beside", [0, 1, 15, 63])
def test_a_rows_noise_does_not_change_with_the_rows_drawn_beside_it(beside: int) -> None:
    """Row 7's numbers, drawn alone or in one call with 1, 15 or 63 other rows before and after it, in
    every lane and both dtypes, and by (position, candidate) counters."""
    seeds = list(range(100, 100 + beside // 2)) + [7] + list(range(200, 200 + beside - beside // 2))
    alone, together = draws_for(7), draws_for(*seeds)
    at = seeds.index(7)
    for lane in (SAMPLE, ORDER):
        for dtype in (torch.float64, torch.float32):
            assert torch.equal(together.uniform((5, 11), dtype, lane)[at], alone.uniform((5, 11), dtype, lane)[0])
    index = torch.arange(4)[:, None] * 2**32 + torch.arange(9)[None, :]
    rows = torch.full((4,), at)
    assert torch.equal(
        together.uniform_at(rows, index, SAMPLE), alone.uniform_at(torch.zeros(4, dtype=torch.long), index, SAMPLE)
    )


def test_counter_noise_is_uniform_and_lanes_and_rows_are_unrelated() -> None:
    u = draws_for(*range(64)).uniform((4096,), torch.float64, SAMPLE)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 45  # chi-square, 15 degrees of freedom: p ~ 1e-4
    other_lane = draws_for(*range(64)).uniform((4096,), torch.float64, ORDER)
    assert abs(float(torch.corrcoef(torch.stack([u.flatten(), other_lane.flatten()]))[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(u[:2])[0, 1])) < 0.05  # two rows of neighbouring seeds


def test_a_draw_follows_softmax_never_picks_an_excluded_candidate_and_ignores_padding_columns() -> None:
    """`draw` (inverse CDF, one number per position): the tempered distribution over 20,000 positions,
    never a column at -inf, and the same picks when batch mates widen the candidates with -inf columns."""
    from celeris_cli.decode.predict import draw

    scores = torch.tensor([2.0, float("-inf"), 1.0, 0.0, float("-inf"), -1.0], dtype=torch.float64)
    N = 20_000
    rows = draws_for(*range(8))
    picks = draw(scores.expand(N, -1).clone(), at([N // 8] * 8), rows)
    seen = torch.bincount(picks, minlength=6).double() / N
    assert seen[1] == seen[4] == 0
    assert torch.allclose(seen, scores.softmax(0), atol=0.012)
    wider = torch.cat([scores.expand(N, -1), torch.full((N, 9), float("-inf"), dtype=torch.float64)], 1)
    assert torch.equal(draw(wider, at([N // 8] * 8), rows), picks)
