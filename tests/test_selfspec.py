"""Self-speculative decoding (`spec`): each round verifies the row's draft causally and, where it drafts,
appends a block of masks whose guesses are the next draft. The verifier is the AR mode, so the answer is the
AR mode's token for token, greedy and sampled, alone and batched, at any width in flight and whichever way
the per-round choice goes; only the forwards change. Nemotron-Labs-Diffusion's tiny checkpoint has both
modes; its drafts rarely agree with its AR mode, so a perfect draft (the AR answer, put in where the masks'
guesses are read) shows how many tokens a round accepts and that the cache stays exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.decode import pace, selfspec
from celeris_cli.decode.pace import ForwardCost, Pace
from celeris_cli.decode.strategies import plan_for

DATA = Path(__file__).parent / "data" / "nemotron"
FOLDER = DATA / "nemotron_tiny"
REF = json.loads((DATA / "nemotron_reference.json").read_text(encoding="utf-8"))
PROMPTS = [list(p) for p in dict.fromkeys(tuple(c["input_ids"]) for c in REF["ar_generate"]["cases"])]
EOS = REF["ids"]["eos"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def _ar(engine: Any, n: int, temperature: float = 0.0) -> Any:
    return engine.params({"strategy": "ar", "gen_length": n, "temperature": temperature})


def _spec(engine: Any, n: int, **extra: Any) -> Any:
    return engine.params({"strategy": "spec", "gen_length": n, "temperature": 0.0, **extra})


def test_spec_is_the_default_of_the_model_with_both_modes(engine) -> None:  # type: ignore[no-untyped-def]
    assert engine.params({}).strategy == "spec"


@pytest.mark.parametrize("drafting", ["always", "never", "auto"])
@pytest.mark.parametrize("steps", [40, 10, 4])
def test_greedy_self_speculation_is_the_ar_mode_alone_and_batched(engine, drafting, steps) -> None:  # type: ignore[no-untyped-def]
    n = 40
    ar, _ = engine.decode_ids(PROMPTS, _ar(engine, n))
    spec = _spec(engine, n, drafting=drafting, denoise_steps=steps)
    assert len({len(p) for p in PROMPTS}) > 1  # left padding is exercised
    assert engine.decode_ids(PROMPTS, spec)[0] == ar
    assert [engine.decode_ids([p], spec)[0][0] for p in PROMPTS] == ar


def test_sampled_self_speculation_draws_the_ar_modes_tokens_from_the_same_streams(engine) -> None:  # type: ignore[no-untyped-def]
    seeds = [3, 4, 5, 6][: len(PROMPTS)]
    ar, _ = engine.decode_ids(PROMPTS, _ar(engine, 32, temperature=1.0), seeds=seeds)
    spec = _spec(engine, 32, temperature=1.0, drafting="always", denoise_steps=6)
    assert engine.decode_ids(PROMPTS, spec, seeds=seeds)[0] == ar
    assert engine.decode_ids(PROMPTS[1:2], spec, seeds=[seeds[1]])[0][0] == ar[1]
    assert engine.decode_ids(PROMPTS[1:2], spec, seeds=[9])[0][0] != ar[1]


def _oracle(answers: dict[int, list[int]], wrong_at: int | None) -> Any:
    """Masks that guess the AR answer (row -> its answer ids), wrong at draft column `wrong_at` if given."""

    def guess(net, h, rows, first, pick):  # type: ignore[no-untyped-def]
        out = torch.empty(h.shape[:2], dtype=torch.long)
        for i, (r, t) in enumerate(zip(rows.tolist(), first.tolist())):
            want = (answers[r] + [EOS] * 64)[t : t + h.shape[1]]
            out[i] = torch.tensor(want)
            if wrong_at is not None:
                out[i, wrong_at] = (want[wrong_at] + 1) % 100 + 200
        return out

    return guess


@pytest.mark.parametrize(
    ("steps", "wrong_at", "per_round"), [(5, None, 5), (7, None, 3), (5, 1, 2)], ids=["w5", "w3", "w5-wrong-2nd"]
)
def test_a_round_accepts_the_agreeing_draft_and_one_token_more(engine, monkeypatch, steps, wrong_at, per_round) -> None:  # type: ignore[no-untyped-def]
    """gen_length 21 over denoise_steps 5 drafts 5 wide (4 guesses after the bonus's place): a perfect draft
    gives 5 tokens a round, denoise_steps 7 gives 3; one wrong at the second guess, 2 (the first guess, then
    the verifier's own), and the next round has no draft to verify. The text after each round is decoded on
    from the cache that round left, so the answer is the AR mode's only if the cache holds exactly the
    committed tokens' keys and values."""
    n, prompts = 21, [PROMPTS[0], PROMPTS[2]]
    ar, _ = engine.decode_ids(prompts, _ar(engine, n))
    assert all(EOS not in row for row in ar) and len(prompts[0]) != len(prompts[1])  # to the end, left-padded
    monkeypatch.setattr(selfspec, "_guess", _oracle(dict(enumerate(ar)), wrong_at))
    before = engine.drafted, engine.accepted
    got, forwards = engine.decode_ids(prompts, _spec(engine, n, drafting="always", denoise_steps=steps))
    assert got == ar
    # the prefill (token 1: the rows that join together, in one packed forward), a round with no draft
    # (token 2, and the first draft), then whole rounds
    prefills = 1
    if wrong_at is None:
        assert forwards == prefills + 1 + -(-(n - 2) // per_round)
        assert engine.accepted - before[1] == engine.drafted - before[0] > 0
    else:  # rounds alternate: a draft (2 tokens), then none (1 token and a new draft)
        assert forwards > prefills + 1 + -(-(n - 2) // 5)
        assert 0 < engine.accepted - before[1] < engine.drafted - before[0]
    never, ar_forwards = engine.decode_ids(prompts, _spec(engine, n, drafting="never", denoise_steps=steps))
    assert never == ar and ar_forwards == prefills + n - 1  # one token a forward: the prefill and n - 1 steps


def test_the_same_requests_give_the_same_tokens_at_widths_1_16_and_64(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """64 sampled requests decoded 1, 16 and 64 at a time: the width in flight changes each round's choice
    (on this cost model drafting pays at width 1, not at 64), never a token."""
    monkeypatch.setattr(engine, "_forward_cost", ForwardCost(fixed=0.004, per_position=1e-4))
    # the choice from this cost model alone: no yield learned by earlier tests on this engine (in whatever order
    # the workers run them), no wall-time overhead measured on a loaded machine
    monkeypatch.setattr(engine, "_learned", {})
    monkeypatch.setattr(Pace, "took", lambda self, drafted, positions, seconds: None)
    texts = [engine.tokenizer.decode(p) for p in PROMPTS]
    prompts = [texts[i % len(texts)] for i in range(64)]
    params = _spec(engine, 24, temperature=0.8, denoise_steps=6)  # drafts 4 wide
    seeds = list(range(64))
    runs, drafted = {}, {}
    for w in (1, 16, 64):
        before = engine.drafted
        runs[w] = [r.text for r in engine.generate(prompts, params, batch_size=w, seeds=seeds)]
        drafted[w] = engine.drafted - before
    assert drafted[1] > 0 and drafted[64] == 0  # the choice went both ways
    assert runs[1] == runs[16] == runs[64] and len(set(runs[64])) > len(texts)  # the seeds matter
    ar = [r.text for r in engine.generate(prompts, _ar(engine, 24, temperature=0.8), batch_size=64, seeds=seeds)]
    assert runs[64] == ar


def test_the_pace_drafts_where_a_forward_costs_its_fixed_part_and_not_where_it_costs_its_positions() -> None:
    k = torch.full((4,), 3)
    fixed = Pace("auto", 4, ForwardCost(fixed=0.010, per_position=1e-6), None)
    assert fixed.drafts(1, k[:1]) and fixed.drafts(4, k)
    compute = Pace("auto", 4, ForwardCost(fixed=1e-5, per_position=1e-3), None)
    assert not compute.drafts(1, k[:1]) and not compute.drafts(64, torch.full((64,), 3))
    mixed = Pace("auto", 4, ForwardCost(fixed=0.004, per_position=1e-4), None)
    assert mixed.drafts(1, k[:1]) and not mixed.drafts(64, torch.full((64,), 3))  # by the width in flight
    wide = Pace("auto", 2, ForwardCost(fixed=1e-3, per_position=1e-4), None)
    for _ in range(20):  # drafts that yield 4 tokens a row: worth 4 positions a row against one, 16 rows wide
        wide.saw(1, 4, True)
    assert wide.drafts(16, torch.ones(16, dtype=torch.long))
    for _ in range(20):  # drafts that never agree: a drafting round yields one token a row
        mixed.saw(1, 1, True)
    assert not mixed.drafts(1, k[:1])
    assert Pace("always", 4, None, None).drafts(64, k) and not Pace("never", 4, None, None).drafts(1, k)
    slow = Pace("auto", 4, ForwardCost(fixed=0.010, per_position=1e-6), None)
    assert slow.drafts(1, k[:1])
    for _ in range(5):  # its drafting rounds took three times the calibrated forward (the decoder's own work)
        slow.took(True, 8, 3 * 0.010)
        slow.took(False, 1, 0.010)
    assert not slow.drafts(1, k[:1])
    assert not Pace("always", 1, None, None).drafts(1, k)  # a width of 1 has no guess after the bonus's place


def test_the_engine_calibrates_its_forward_cost_once(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[int] = []
    real = pace.calibrate

    def counting(model: Any) -> ForwardCost:
        calls.append(1)
        return real(model, ((1, 1), (4, 4)))

    monkeypatch.setattr(pace, "calibrate", counting)
    monkeypatch.setattr(engine, "_forward_cost", None)
    for _ in range(2):
        engine.decode_ids(PROMPTS[:1], _spec(engine, 8))
    engine.decode_ids(PROMPTS[:1], _spec(engine, 8, drafting="never"))
    assert len(calls) == 1 and engine.forward_cost().fixed > 0


def test_the_calibration_is_kept_on_disk_per_machine_device_and_dtype(engine, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A second process (an engine of its own) reads the first one's calibration; another dtype calibrates
    its own; a damaged file is calibrated over."""
    calls: list[int] = []

    def counting(model: Any) -> ForwardCost:
        calls.append(1)
        return ForwardCost(0.001 * len(calls), 1e-5)

    monkeypatch.setattr(pace, "calibrate", counting)
    first = pace.cached_calibration(engine.model, tmp_path)
    again = pace.cached_calibration(engine.model, tmp_path)
    assert len(calls) == 1 and again == first
    monkeypatch.setattr(engine, "_forward_cost", None)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert engine.forward_cost() == ForwardCost(0.002, 1e-5) and len(calls) == 2  # calibrated once, then kept
    monkeypatch.setattr(engine, "_forward_cost", None)
    assert engine.forward_cost() == ForwardCost(0.002, 1e-5) and len(calls) == 2
    half = load_engine(FOLDER, device="cpu", dtype="bfloat16")
    assert pace.machine_key(half.model) != pace.machine_key(engine.model)
    assert pace.cached_calibration(half.model, tmp_path) == ForwardCost(0.003, 1e-5)
    (tmp_path / pace.CACHE_FILE).write_text("{not json", encoding="utf-8")
    assert pace.cached_calibration(engine.model, tmp_path) == ForwardCost(0.004, 1e-5)
    assert pace.cached_calibration(engine.model, tmp_path) == ForwardCost(0.004, 1e-5) and len(calls) == 4


def test_what_drafting_yielded_is_kept_across_decodes_so_only_the_first_explores(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    k = torch.ones(1, dtype=torch.long)
    cost = ForwardCost(fixed=0.004, per_position=1e-4)
    shared = pace.Learned()
    first = Pace("auto", 4, cost, None, shared)
    assert first.drafts(1, k)  # the prior: the first rounds try
    for _ in range(20):  # drafts that never agree
        first.saw(1, 1, True)
    assert not Pace("auto", 4, cost, None, shared).drafts(1, k)  # the next decode starts from what was seen
    assert Pace("auto", 4, cost, None).drafts(1, k)  # one of its own would explore again

    monkeypatch.setattr(engine, "_forward_cost", cost)
    monkeypatch.setattr(engine, "_learned", {})
    monkeypatch.setattr(Pace, "took", lambda *a: None)  # the measured overheads held at 1: the yield decides
    params = _spec(engine, 24, temperature=0.8, denoise_steps=6)
    seen = engine.learned(plan_for(params))
    engine.decode_ids(PROMPTS[:1], params)  # one row: its first rounds draft on the prior
    assert seen.rows > pace.PRIOR_WEIGHT and engine.learned(plan_for(params)) is seen
    rows = seen.rows
    engine.generate([engine.tokenizer.decode(PROMPTS[0])], params, batch_size=1)  # the running set's lane too
    assert engine.learned(plan_for(params)) is seen and seen.rows >= rows
    other = _spec(engine, 24, temperature=0.5, denoise_steps=6)  # another sampler: its own record
    assert engine.learned(plan_for(other)) is not seen


REGEX = json.dumps({"regex": "[0-9]{3}-[a-z]{2,5}"})


@pytest.mark.parametrize("drafting", ["always", "never"])
def test_a_constrained_answer_follows_its_grammar_whether_or_not_rounds_draft(engine, drafting) -> None:  # type: ignore[no-untyped-def]
    import re

    texts = [engine.tokenizer.decode(p) for p in PROMPTS]
    params = _spec(engine, 16, structured_outputs=REGEX, drafting=drafting, denoise_steps=4)
    results = engine.generate(texts, params, batch_size=len(texts))
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", r.text) and r.finish_reason == "stop" for r in results)
    plain = engine.generate(texts, _spec(engine, 16, drafting=drafting, denoise_steps=4), batch_size=len(texts))
    assert [r.text for r in plain] != [r.text for r in results]  # the grammar changed the answers


def test_constrained_answers_are_the_same_drafted_or_not(engine) -> None:  # type: ignore[no-untyped-def]
    texts = [engine.tokenizer.decode(p) for p in PROMPTS]
    runs = [
        [
            r.text
            for r in engine.generate(texts, _spec(engine, 16, structured_outputs=REGEX, drafting=d, temperature=0.9))
        ]
        for d in ("always", "never")
    ]
    assert runs[0] == runs[1]


def test_log_probabilities_are_those_of_the_ar_modes_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    texts = [engine.tokenizer.decode(p) for p in PROMPTS]
    ar = engine.generate(texts, _ar(engine, 12), batch_size=len(texts))
    for drafting in ("always", "never"):
        got = engine.generate(
            texts, _spec(engine, 12, logprobs=True, top_logprobs=2, drafting=drafting, denoise_steps=3)
        )
        assert [r.text for r in got] == [r.text for r in ar]
        for r in got:
            assert r.logprobs is not None and len(r.logprobs) == r.output_tokens
            assert all(e["logprob"] <= 0 and e["logprob"] == e["top_logprobs"][0]["logprob"] for e in r.logprobs)


def test_the_template_layout_is_refused_by_name(engine) -> None:  # type: ignore[no-untyped-def]
    from celeris_cli.errors import UsageError

    schema = json.dumps({"json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}})
    with pytest.raises(UsageError, match="structured_layout template: the spec strategy decides an answer left"):
        engine.params({"strategy": "spec", "structured_outputs": schema, "structured_layout": "template"})


SHAPING = {"presence_penalty": 1.5, "min_tokens": 6, "subword_min_p": 0.5, "temperature": 0.9}


def test_the_shaping_reads_each_columns_own_history_as_the_ar_mode_does(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The presence penalty, min_tokens and subword_min_p change the answer, and self-speculation with them
    is the AR mode with them, token for token: with perfect drafts every verify column's history holds draft
    tokens, which the penalty must count as the AR mode's history holds them."""
    texts = [engine.tokenizer.decode(p) for p in PROMPTS]
    seeds = list(range(len(texts)))

    def ar(shaping: dict[str, Any]) -> list[str]:
        params = engine.params({"strategy": "ar", "gen_length": 20, "temperature": 0.9, **shaping})
        return [r.text for r in engine.generate(texts, params, seeds=seeds)]

    shaped = ar(SHAPING)
    assert shaped != ar({})
    for drafting in ("always", "never"):
        params = _spec(engine, 20, drafting=drafting, denoise_steps=4, **SHAPING)
        assert [r.text for r in engine.generate(texts, params, seeds=seeds)] == shaped
    ids = engine.decode_ids(PROMPTS, engine.params({"strategy": "ar", "gen_length": 20, **SHAPING}), seeds=seeds)[0]
    monkeypatch.setattr(selfspec, "_guess", _oracle(dict(enumerate(ids)), None))
    before = engine.accepted
    params = _spec(engine, 20, drafting="always", denoise_steps=4, **SHAPING)
    assert engine.decode_ids(PROMPTS, params, seeds=seeds)[0] == ids and engine.accepted > before


def test_where_the_shaping_forbids_what_the_grammar_allows_the_grammar_wins(engine) -> None:  # type: ignore[no-untyped-def]
    """min_tokens 6 forbids the end of text that a short choice must end with, subword_min_p may forbid its
    pieces: the position is then decided on the unshaped logits under the grammar's mask (as the block
    decoders do), never on a row of -inf."""
    texts = [engine.tokenizer.decode(p) for p in PROMPTS]
    choice = json.dumps({"choice": ["yes", "no", "maybe"]})
    params = _spec(engine, 12, structured_outputs=choice, **SHAPING)
    for r in engine.generate(texts, params, seeds=list(range(len(texts)))):
        assert r.text in ("yes", "no", "maybe") and r.finish_reason == "stop", r.text


def test_the_memory_planner_counts_a_causal_cache_and_a_round_of_the_drafts_width(engine) -> None:  # type: ignore[no-untyped-def]
    from celeris_cli.arch.memory import plan, request_of, shape_of_model

    shape = shape_of_model(engine.model)

    def peak(batch: int, steps: int) -> int:
        return plan(shape, request_of(_spec(engine, 64, denoise_steps=steps), batch, 16, "float32")).peak

    assert request_of(_spec(engine, 64, denoise_steps=8), 1, 16, "float32").block_length == 8  # the draft's width
    assert peak(1, 16) < peak(16, 16) < peak(64, 16)
    assert peak(16, 16) < peak(16, 2)  # drafts 32 wide: a round of 64 columns and a longer cache
