"""`celeris bench workload mixed`: static batches and the running set side by side, same answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from celeris_cli.errors import UsageError
from celeris_cli.measure.scheduling import compare_scheduling

from .conftest import make_model


@pytest.fixture(scope="module")
def block_model(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Path:
    return make_model(tmp_path_factory.mktemp("sched") / "m", tiny_tokenizer, seed=4, block_causal=True)


def test_the_mixed_workload_runs_static_and_continuous_with_the_same_answers(block_model: Path) -> None:
    from celeris_cli import load_engine

    engine = load_engine(block_model, device="cpu", dtype="float32")
    report = compare_scheduling(engine, n_prompts=6, batch_size=2)
    assert report["answers"] == 6 and report["identical_answers"] == 6
    static, continuous = report["scheduling"]["static"], report["scheduling"]["continuous"]
    for row in (static, continuous):
        assert {"tokens_per_s", "occupancy", "nfe"} <= set(row)
    # answers of 16 to 256 tokens: static batches run half empty at their tails, the running set refills
    assert continuous["occupancy"] > static["occupancy"]
    assert static["output_tokens"] == continuous["output_tokens"]
    # the per-step sampling cost at batch 1, 16 and 64, with and without the LM head
    assert [c["batch_size"] for c in report["commit_step"]] == [1, 16, 64]
    assert all(c["step_ms"] > 0 and c["sampling_ms"] > 0 for c in report["commit_step"])


def test_the_workload_refuses_settings_that_decode_in_static_batches_only() -> None:
    from celeris_cli import load_engine

    engine = load_engine(None, device="cpu", dtype="float32")  # the default model: its ar is static
    with pytest.raises(UsageError, match="ar decodes in static batches only"):
        compare_scheduling(engine, n_prompts=2, batch_size=2, settings={"strategy": "ar"})


def test_the_mixed_workload_runs_a_bidirectional_model_through_the_waves(engine) -> None:  # type: ignore[no-untyped-def]
    report = compare_scheduling(engine, n_prompts=6, batch_size=2)
    assert report["answers"] == 6 and report["identical_answers"] == 6
    assert report["scheduling"]["continuous"]["occupancy"] > report["scheduling"]["static"]["occupancy"]
    assert report["commit_step"] == []  # the block decoders' commit step only


def test_pairs_alternate_which_mode_goes_first_and_the_speedup_is_their_median(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--pairs N`: N runs of each mode, static first in the first pair and second in the next, so a slow
    stretch of a shared machine falls on both; the speedup is the median of the pairs' ratios."""
    order: list[bool] = []
    decode = engine.decode_running

    def spy(*args, refill: bool = True, **kw):  # type: ignore[no-untyped-def]
        order.append(refill)
        return decode(*args, refill=refill, **kw)

    monkeypatch.setattr(engine, "decode_running", spy)
    report = compare_scheduling(engine, n_prompts=4, batch_size=2, pairs=3)
    assert order[1:] == [False, True, True, False, False, True]  # after the warm-up: S C, C S, S C
    ratios = [p["ratio"] for p in report["pairs"]]
    assert len(ratios) == 3 and report["speedup"] == sorted(ratios)[1]
    for mode in ("static", "continuous"):
        assert report["scheduling"][mode]["tokens_per_s"] == sorted(p[mode] for p in report["pairs"])[1]
    assert report["identical_answers"] == 4  # the same text in all six runs


def test_every_strategy_runs_in_a_running_set_or_says_why_not_and_the_docs_table_follows() -> None:
    from celeris_cli.strategy import STRATEGIES

    table = (Path(__file__).parent.parent / "docs" / "scheduling.md").read_text(encoding="utf-8")
    for name, s in STRATEGIES.items():
        assert (s.running is None) == bool(s.static_because), name
        if s.running is None:
            assert f"| `{name}` | {s.static_because} |" in table, name
    assert STRATEGIES["nemotron"].running == "seeded"
