"""The lean prediction of the fast decoder: the same survivors, distribution and confidence as over the
whole vocabulary, and draws that depend on the row alone."""

from __future__ import annotations

import pytest
import torch

from celeris_cli.decode.fast import confidence_of
from celeris_cli.decode.predict import candidates, confidence_masked, sample_masked
from celeris_cli.decode.sampling import filtered_scores
from celeris_cli.params import Sampling


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
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    x0 = sample_masked(logits, sampling(min_p=0.2, temperature=1.0), [1000] * 4, gens)
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
    alone = sample_masked(sharp, s, [6], [torch.Generator().manual_seed(7)])
    together = sample_masked(
        torch.cat([sharp, flat]), s, [6, 9], [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    )
    assert torch.equal(alone, together[:6])
    assert len(set(together[6:].tolist())) > 1  # the flat row really samples


@pytest.mark.parametrize("kind", ["prob", "margin", "lead", "entropy"])
def test_confidence_matches_the_full_softmax_definition(kind: str) -> None:
    logits = logits_with_ties(30, 300, seed=3)
    x0 = sample_masked(logits, sampling(min_p=0.01), [30], [torch.Generator().manual_seed(0)])
    expected = confidence_of(logits[None], x0[None], kind)[0]  # type: ignore[arg-type]
    assert torch.allclose(confidence_masked(logits, x0, kind), expected, atol=1e-6)  # type: ignore[arg-type]


def test_temperature_zero_is_the_argmax() -> None:
    logits = logits_with_ties()
    assert torch.equal(sample_masked(logits, sampling(temperature=0.0), [40], []), logits.argmax(-1))


@pytest.mark.parametrize("kw", [*SETTINGS, {}], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "none")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampled_token_s_probability_is_that_of_the_filtered_distribution(kw: dict, temperature: float) -> None:
    """The block decoders' confidence, from the survivors alone, equals the whole-vocabulary filtered
    softmax at the token drawn (filters at temperature 1 when greedy), and the draw is sample_masked's.
    Without ties: where top-p cuts through tied tokens, the whole-vocabulary sort keeps an arbitrary subset."""
    from celeris_cli.decode.predict import sample_with_probability

    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(0)) * 3
    s = sampling(**{**kw, "temperature": temperature})
    counts = [10, 0, 30]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    x0, prob = sample_with_probability(logits, s, counts, gens)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert torch.equal(x0, sample_masked(logits, s, counts, gens))
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
