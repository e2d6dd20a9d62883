from __future__ import annotations

import pytest
import torch

from celeris_cli.decode.reference import FullLogits, generate_reference, num_transfer_tokens
from celeris_cli.decode.sampling import Draws, RowNoise, order_scores, stream_seed
from celeris_cli.errors import UsageError
from celeris_cli.params import GenerationParams, Sampling, split_steps

from .conftest import noise, plan
from .oracles import confidence_of, sample_tokens

MASK = 4


class RecordingModel:
    """A fake at the model boundary: deterministic logits that depend on the whole canvas, and a record of
    every call (so tests can see what the decoder fed the model)."""

    def __init__(self, vocab: int = 40, eos: int | None = None, eos_from: int = 10**9) -> None:
        self.vocab = vocab
        self.eos = eos
        self.eos_from = eos_from
        self.calls: list[torch.Tensor] = []
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab, vocab, generator=g)

    def __call__(self, ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        self.calls.append(ids.clone())
        pos = (key_mask.long().cumsum(1) - 1).clamp_min(0)
        logits = self.table[ids] + torch.sin(pos[..., None].float() * torch.arange(self.vocab) / 7)
        logits[..., MASK] = -1e9  # never predict the mask itself
        if self.eos is not None:
            logits[..., self.eos] = torch.where(pos >= self.eos_from, 1e9, -1e9)
        return logits


def test_split_steps_spreads_any_count_over_blocks() -> None:
    assert split_steps(10, 3) == [4, 3, 3]
    assert split_steps(1, 4) == [1, 1, 1, 1]
    assert sum(split_steps(64, 2)) == 64


def test_linear_schedule_commits_every_masked_token() -> None:
    sched = num_transfer_tokens(torch.tensor([10, 7, 0]), 4)
    assert sched.tolist() == [[3, 3, 2, 2], [2, 2, 2, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("steps", [1, 3, 7, 12])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_no_mask_remains_and_prompt_never_changes(steps: int, remasking: str) -> None:
    model = RecordingModel()
    prompt = torch.tensor([[3, 3, 11, 12], [13, 14, 15, 16]])
    pmask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    p = plan(gen_length=12, block_length=5, denoise_steps=steps, temperature=0.7, remasking=remasking)
    out = generate_reference(FullLogits(model), prompt, pmask, p, MASK, noise(2))
    assert out.shape == (2, 16)
    assert not (out == MASK).any()
    assert torch.equal(out[:, :4], prompt)
    for canvas in model.calls:  # the prompt is intact at every step, not only at the end (padding aside)
        assert torch.equal(canvas[:, :4][pmask], prompt[pmask])
    assert (
        len(model.calls)
        == sum(p.schedule.steps_per_block)
        == sum(min(n, 5) for n in split_steps(steps, 3)[:2]) + min(split_steps(steps, 3)[2], 2)
    )


def test_committed_tokens_are_never_remasked() -> None:
    model = RecordingModel()
    prompt = torch.tensor([[11, 12]])
    p = plan(gen_length=8, block_length=8, denoise_steps=8)
    generate_reference(FullLogits(model), prompt, torch.ones_like(prompt, dtype=torch.bool), p, MASK, noise(1))
    for before, after in zip(model.calls, model.calls[1:]):
        committed = before != MASK
        assert torch.equal(after[committed], before[committed])
        assert (after == MASK).sum() == (before == MASK).sum() - 1


def test_same_seed_same_output_and_different_seed_differs() -> None:
    prompt = torch.tensor([[11, 12, 13]])
    pm = torch.ones_like(prompt, dtype=torch.bool)
    p = plan(gen_length=16, block_length=8, denoise_steps=16, temperature=1.0)
    runs = [generate_reference(FullLogits(RecordingModel()), prompt, pm, p, MASK, noise(1, seed=s)) for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_cfg_pass_sees_the_prompt_masked() -> None:
    model = RecordingModel()
    prompt = torch.tensor([[3, 11, 12]])
    pm = torch.tensor([[False, True, True]])
    generate_reference(
        FullLogits(model),
        prompt,
        pm,
        plan(gen_length=4, block_length=4, denoise_steps=2, cfg_scale=1.5),
        MASK,
        noise(1),
    )
    cond, un = model.calls[:2]  # each step: the conditional pass, then the unconditional one
    assert cond.shape == (1, 6) and torch.equal(cond[0, :2], prompt[0, 1:])  # the row laid out without padding
    assert (un[0, :2] == MASK).all() and torch.equal(un[0, 2:], cond[0, 2:])  # its prompt masked, only that
    assert len(model.calls) == 4  # two steps, two forward passes each


@pytest.mark.parametrize(
    "bad",
    [
        dict(denoise_steps=0),
        dict(gen_length=-1),
        dict(block_length=0),
        dict(temperature=-1.0),
        dict(remasking="sideways"),
        dict(min_p=1.0),
        dict(min_p=-0.1),
        dict(order_temperature=-0.5),
    ],
)
def test_invalid_parameters_are_user_errors(bad: dict) -> None:
    with pytest.raises(UsageError):
        GenerationParams.from_mapping(bad)


def draws_for(rows: int) -> Draws:
    """One step's draws for `rows` rows of seeds 0, 1, ..."""
    return Draws([stream_seed(r, 0, 0) for r in range(rows)], torch.device("cpu"))


def sampling(**kw: float) -> Sampling:
    return Sampling(**{"temperature": 1.0, "min_p": 0.0, "top_p": 1.0, "top_k": 0, **kw})  # type: ignore[arg-type]


# Tempered probabilities at T = 1: token 1 is e^-1 = 0.37 of token 0; tokens 2 and 3 are under 0.01 of it.
TAIL_LOGITS = torch.tensor([5.0, 4.0, 0.0, -1.0, 3.0 - 1e9])


def test_min_p_drops_the_tail_and_keeps_the_spread_among_the_rest() -> None:
    logits = TAIL_LOGITS.expand(1, 4000, -1)
    g = draws_for(1)
    free = torch.bincount(sample_tokens(logits, sampling(), g)[0], minlength=5)
    cut = torch.bincount(sample_tokens(logits, sampling(min_p=0.2), g)[0], minlength=5)
    assert free[2] + free[3] > 0  # the tail is sampled without min-p (expected about 26 of 4000)
    assert cut[2] == cut[3] == cut[4] == 0 and cut[0] + cut[1] == 4000
    assert 0.22 < cut[1] / 4000 < 0.32  # renormalised: e^-1 / (1 + e^-1) = 0.27, not collapsed to greedy
    x0 = sample_tokens(logits, sampling(min_p=0.2), g)
    conf = confidence_of(logits, x0, "prob")
    assert set(x0.flatten().tolist()) == {0, 1} and torch.allclose(conf[x0 == 0], torch.softmax(TAIL_LOGITS, -1)[0])


def test_reference_decoder_samples_only_inside_min_p() -> None:
    def fixed(ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return TAIL_LOGITS.expand(*ids.shape, -1).clone()

    prompt, pmask = torch.full((32, 2), 3), torch.ones(32, 2, dtype=torch.bool)
    settings = dict(gen_length=32, block_length=8, denoise_steps=32, temperature=1.0, remasking="random")
    out = generate_reference(FullLogits(fixed), prompt, pmask, plan(**settings, min_p=0.2), MASK, noise(32, seed=1))
    assert set(out[:, 2:].unique().tolist()) == {0, 1}
    rows = RowNoise(list(range(32)), torch.device("cpu"))  # 32 seeds: 1,024 draws (32 rows alike draw 32)
    loose = generate_reference(FullLogits(fixed), prompt, pmask, plan(**settings, min_p=0.001), MASK, rows)
    assert set(loose[:, 2:].unique().tolist()) - {0, 1}  # 1,024 draws reach the tail when it is allowed


def test_lead_is_the_margin_of_the_sampled_token_over_its_best_rival() -> None:
    logits = TAIL_LOGITS.expand(1, 4000, -1)
    p = torch.softmax(TAIL_LOGITS, -1)
    x0 = sample_tokens(logits, sampling(), draws_for(1))
    lead = confidence_of(logits, x0, "lead")
    assert (x0 == 0).any() and (x0 == 1).any()
    assert torch.allclose(lead[x0 == 0], p[0] - p[1])  # the favourite leads by top1 - top2
    assert torch.allclose(lead[x0 == 1], p[1] - p[0])  # a sampled runner-up trails the favourite
    assert (lead[x0 != 0] < 0).all()
    margin = confidence_of(logits, x0, "margin")
    assert torch.allclose(margin, p[0] - p[1])  # Dream's margin ignores which token was drawn
    greedy = logits.argmax(-1)
    assert torch.allclose(confidence_of(logits, greedy, "lead"), confidence_of(logits, greedy, "margin"))


def test_order_noise_fades_over_the_block_and_is_off_at_zero() -> None:
    conf = torch.tensor([[0.9, 0.5, 0.2, 0.05]]).expand(2000, -1)
    assert order_scores(conf, 0.0, 1.0, draws_for(0)) is conf  # off: the confidence itself, no draw
    rows = draws_for(2000)
    early = order_scores(conf, 2.0, 1.0, rows).argmax(1)
    late = order_scores(conf, 2.0, 0.25, rows).argmax(1)

    # Gumbel-max on log(conf) / tau picks position j first with probability conf_j^(1/tau) / sum: at the
    # block's first step (tau 2) the least confident position still goes first sometimes (MaskGIT) ...
    def share(picks: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
        w = conf[0] ** (1 / tau)
        return torch.bincount(picks, minlength=4) / len(picks), w / w.sum()

    seen, expected = share(early, 2.0)
    assert torch.allclose(seen, expected, atol=0.04) and seen[3] > 0.05
    # ... and at its last step (tau 0.5) the order leans hard on the confidence again
    seen, expected = share(late, 0.5)
    assert torch.allclose(seen, expected, atol=0.04) and seen[0] > 0.7
    plain = generate_reference(
        FullLogits(lambda ids, km: torch.zeros(*ids.shape, 12)),
        torch.full((2, 2), 3),
        torch.ones(2, 2, dtype=torch.bool),
        plan(gen_length=8, block_length=8, denoise_steps=4, order_temperature=3.0),
        MASK,
        noise(2),
    )
    assert (plain[:, 2:] != MASK).all()  # every position is still committed


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_reference_rows_that_leave_when_finished_keep_their_answers(eos_prone, cfg_scale: float) -> None:
    """The measurement-only early exit of the reference decoder (`stop_ids`): every answer up to its first
    stop token is the one decoded to the end of the canvas, and finished rows stop being computed, in later
    blocks and within one."""
    from celeris_cli.decode.sampling import RowNoise, request_seed
    from celeris_cli.decode.strategies import Net

    class Rows(Net):
        def __init__(self, model) -> None:
            super().__init__(model)
            self.rows: list[int] = []

        def hidden(self, ids, positions, key_mask, cache=None, start=0, keep_kv=True):  # type: ignore[no-untyped-def]
            self.rows.append(len(cache[0].segments))  # a packed forward: a segment a row
            return super().hidden(ids, positions, key_mask, cache, start, keep_kv)

    prompts = ["春风", "明月", "江南好", "山中", "白日依山尽", "夜来", "床前", "故人"] * 2
    encoded = [eos_prone.encode_prompt(p) for p in prompts]
    P = max(map(len, encoded))
    prompt = torch.tensor([[eos_prone.tokenizer.pad_id] * (P - len(i)) + i for i in encoded])
    pmask = torch.tensor([[False] * (P - len(i)) + [True] * len(i) for i in encoded])
    p = plan(
        gen_length=32, block_length=8, denoise_steps=32, temperature=1.0, order_temperature=1.0, cfg_scale=cfg_scale
    )
    stop = eos_prone.special.stop_ids
    mask = eos_prone.tokenizer.mask_id
    nets = [Rows(eos_prone.model), Rows(eos_prone.model)]
    streams = RowNoise([request_seed(8, ids) for ids in encoded], torch.device("cpu"))  # each row its own
    whole = generate_reference(nets[0], prompt, pmask, p, mask, streams)
    left = generate_reference(nets[1], prompt, pmask, p, mask, streams, stop)
    assert not (left == mask).any()
    stopped = 0
    for a, b in zip(left[:, P:].tolist(), whole[:, P:].tolist()):
        cut = next((i for i, t in enumerate(b) if t in stop), len(b))
        stopped += cut < len(b)
        assert a[: cut + 1] == b[: cut + 1]
    assert 0 < stopped < len(prompts)  # some rows end early, some do not (the seed is one that gives both)
    assert set(nets[0].rows) == {len(prompts)}
    calls_per_step = 2 if cfg_scale else 1
    assert nets[1].rows[0] == len(prompts) and min(nets[1].rows) < len(prompts)
    # a row leaves at the step it finishes, not at its block's end: the count changes within a block
    per_step = nets[1].rows[::calls_per_step]
    steps = p.schedule.steps_per_block[0]
    assert any(per_step[k] != per_step[k + 1] for k in range(len(per_step) - 1) if (k + 1) % steps)


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_reference_stops_computing_when_every_row_has_left(remasking: str) -> None:
    from celeris_cli.decode.sampling import RowNoise

    prompt = torch.tensor([[3, 3, 11, 12], [13, 14, 15, 16]])
    pmask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    p = plan(gen_length=16, block_length=8, denoise_steps=16, temperature=0.7, remasking=remasking)
    models = [RecordingModel(eos=7, eos_from=6), RecordingModel(eos=7, eos_from=6)]  # every row ends early
    streams = RowNoise([11, 12], torch.device("cpu"))
    whole = generate_reference(FullLogits(models[0]), prompt, pmask, p, MASK, streams)
    left = generate_reference(FullLogits(models[1]), prompt, pmask, p, MASK, streams, frozenset({7}))
    assert not (left == MASK).any()
    for a, b in zip(left[:, 4:].tolist(), whole[:, 4:].tolist()):
        cut = b.index(7)
        assert a[: cut + 1] == b[: cut + 1] and cut < 8  # each row ends within the first block
    assert len(models[0].calls) == 16 and len(models[1].calls) <= 8  # none in the second block: all have left
    assert all(len(c) for c in models[1].calls)  # never a forward over no rows


def test_reference_stops_mid_block_when_the_last_row_leaves() -> None:
    from celeris_cli.decode.sampling import RowNoise

    prompt = torch.tensor([[3, 3, 11, 12], [13, 14, 15, 16]])
    pmask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    p = plan(gen_length=16, block_length=16, denoise_steps=16, temperature=0.7, remasking="random")
    model = RecordingModel(eos=7, eos_from=6)
    left = generate_reference(
        FullLogits(model), prompt, pmask, p, MASK, RowNoise([5, 6], torch.device("cpu")), frozenset({7})
    )
    assert not (left == MASK).any()
    assert 0 < len(model.calls) < 16 and all(len(c) for c in model.calls)  # one block, left before its end
