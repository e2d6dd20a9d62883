"""Nemotron-Labs-Diffusion's selection policies in its diffusion mode (`nemotron`): which masked positions of
a block a step commits. Its generation code has three (vLLM's `nemotron_dllm.py`: `low_confidence`,
`leftmost`, `confidence_threshold`); Celeris names them by its own remasking and threshold settings:
low_confidence (the default), sequential (the family's leftmost: the schedule's k leftmost masked positions,
no threshold) and a threshold below 1. Random remasking ranks by a draw from each row's own stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.cli import app
from celeris_cli.errors import UsageError

DATA = Path(__file__).parent / "data" / "nemotron"
FOLDER = DATA / "nemotron_tiny"
REF = json.loads((DATA / "nemotron_reference.json").read_text(encoding="utf-8"))
PROMPTS = [list(p) for p in dict.fromkeys(tuple(c["input_ids"]) for c in REF["ar_generate"]["cases"])]
MASK = REF["ids"]["mask"]
BASE = {"strategy": "nemotron", "gen_length": 24, "block_length": 8, "block_steps": 3, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def _answers(engine: Any, **extra: Any) -> list[list[int]]:
    return engine.decode_ids(PROMPTS, engine.params({**BASE, **extra}))[0]


def test_leftmost_commits_the_schedules_share_of_the_leftmost_masked_positions(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A block of 8 is its seed and 7 masks; 3 steps commit 3, 2 and 2 (the remainder to the first steps).
    Each denoising forward sees the block as it stands: leftmost remasking leaves the masks a suffix of
    7, then 4, then 2, and commits at each step the model's prediction at those positions."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hidden = engine.model.hidden

    def recording(ids, positions, mask, *rest):  # type: ignore[no-untyped-def]
        h, kv = hidden(ids, positions, mask, *rest)
        seen.append((ids.clone(), engine.model.head(h).argmax(-1)))
        return h, kv

    monkeypatch.setattr(engine.model, "hidden", recording)
    [answer], _ = engine.decode_ids(PROMPTS[:1], engine.params({**BASE, "remasking": "sequential"}))
    steps = [(ids[0], pred[0]) for ids, pred in seen if ids.shape[1] == 8 and bool((ids == MASK).any())]
    assert [int((ids == MASK).sum()) for ids, _ in steps] == [7, 4, 2] * 3
    for ids, _ in steps:
        masked = (ids == MASK).nonzero().flatten().tolist()
        assert masked == list(range(8 - len(masked), 8))  # the masks are the block's tail
    for (ids, pred), (after, _) in zip(steps, steps[1:]):
        if int((after == MASK).sum()) < int((ids == MASK).sum()):  # the same block's next step
            newly = (ids == MASK) & (after != MASK)
            assert torch.equal(after[newly], pred[newly])  # what was committed is what the step predicted
    last, pred = steps[2]  # the first block's last step: its two masks take that step's predictions
    assert answer[:8] == torch.where(last == MASK, pred, last).tolist()


def test_each_remasking_changes_the_answer_and_low_confidence_is_the_default(engine) -> None:  # type: ignore[no-untyped-def]
    default = _answers(engine)
    assert _answers(engine, remasking="low_confidence") == default
    leftmost = _answers(engine, remasking="sequential")
    random = _answers(engine, remasking="random")
    assert leftmost != default and random != default and random != leftmost
    assert _answers(engine, remasking="random", seed=1) != random  # the order is drawn from the seed
    assert _answers(engine, order_temperature=2.0, seed=1) != default  # order noise on the confidence


def test_random_order_with_a_threshold_commits_a_random_one_besides_the_sure_ones(engine) -> None:  # type: ignore[no-untyped-def]
    sure = _answers(engine, threshold=0.3)
    assert _answers(engine, threshold=0.3, remasking="random") != sure


@pytest.mark.parametrize(
    "extra",
    [{"remasking": "sequential"}, {"remasking": "random"}, {"order_temperature": 1.0}, {"temperature": 1.0}],
    ids=["sequential", "random", "order-noise", "sampled"],
)
def test_a_row_answers_in_a_batch_as_it_does_alone(engine, extra) -> None:  # type: ignore[no-untyped-def]
    params = engine.params({**BASE, **extra})
    seeds = [11, 12, 13, 14]
    together, _ = engine.decode_ids(PROMPTS, params, seeds=seeds)
    assert len({len(p) for p in PROMPTS}) > 1  # left padding is exercised
    assert together == [engine.decode_ids([p], params, seeds=[s])[0][0] for p, s in zip(PROMPTS, seeds)]


def test_leftmost_with_a_threshold_is_refused_by_name(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="threshold: sequential remasking commits the leftmost"):
        engine.params({**BASE, "remasking": "sequential", "threshold": 0.5})
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(FOLDER), "--prompt", "hi", "--strategy", "nemotron"]
        + ["--remasking", "sequential", "--threshold", "0.5"],
    )
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "--threshold: sequential remasking" in result.output


def test_generate_runs_leftmost_from_the_command_line() -> None:
    runs = {}
    for remasking in ("low_confidence", "sequential"):
        result = CliRunner().invoke(
            app,
            ["generate", "--model", str(FOLDER), "--prompt", "hello", "--gen-length", "16", "--block-length", "8"]
            + ["--block-steps", "3", "--remasking", remasking, "--strategy", "nemotron", "--json"],
        )
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        assert record["settings"]["remasking"] == remasking
        runs[remasking] = record["text"]
    assert runs["sequential"] != runs["low_confidence"]
