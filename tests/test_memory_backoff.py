"""Out-of-memory back-off: a batch that runs out of memory is split until its rows fit, every row gets the
answer it gets alone, and a row too large alone fails alone with `too_large`. The out-of-memory error is a
fake at the model boundary: a forward over more rows or positions than a limit raises torch's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.backoff import run_backing_off
from celeris_cli.batch import run_file
from celeris_cli.batch.local import LocalExecutor
from celeris_cli.errors import TooLarge
from celeris_cli.spool.backend import EngineBackend

PROMPTS = ["the cat", "a dog ran far", "one", "birds sing in the morning", "rain", "the old road home"]
LONG = "the long one " * 12
SETTINGS = {"gen_length": 16, "denoise_steps": 8, "block_length": 8}


class OutOfMemoryAbove:
    """The model, except that a forward over more than `rows` rows or `width` positions runs out of memory."""

    def __init__(self, model: Any, rows: int, width: int) -> None:
        self.model, self.rows, self.width = model, rows, width
        self.shapes: list[tuple[int, int]] = []

    def _check(self, ids: torch.Tensor) -> None:
        self.shapes.append(tuple(ids.shape))  # type: ignore[arg-type]
        if ids.shape[0] > self.rows or ids.shape[1] > self.width:
            raise torch.OutOfMemoryError(f"fake: {tuple(ids.shape)}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def hidden(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._check(ids)
        return self.model.hidden(ids, *args, **kwargs)

    def __call__(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._check(ids)
        return self.model(ids, *args, **kwargs)


@pytest.fixture()
def fragile(tiny_model: Path):  # type: ignore[no-untyped-def]
    engine = load_engine(tiny_model, device="cpu", dtype="float32")
    alone = {p: engine.generate([p], engine.params(SETTINGS))[0].text for p in PROMPTS}
    engine.model = OutOfMemoryAbove(engine.model, rows=2, width=40)  # type: ignore[assignment]
    return engine, alone


def test_a_batch_out_of_memory_is_split_and_every_row_answers_as_alone(fragile) -> None:  # type: ignore[no-untyped-def]
    engine, alone = fragile
    results = engine.generate(PROMPTS, engine.params(SETTINGS), batch_size=6, scheduling="static")
    assert [r.text for r in results] == [alone[p] for p in PROMPTS]
    assert max(r.batch_size for r in results) <= 2
    # the full batch was tried first: one packed forward of all six rows' canvases (one row of ids)
    assert max(width for _, width in engine.model.shapes) > 40 >= engine.model.shapes[-1][1]


def test_a_row_too_large_alone_fails_alone_naming_the_memory_it_needs(fragile) -> None:  # type: ignore[no-untyped-def]
    engine, _ = fragile
    with pytest.raises(TooLarge, match=r"needs about [\d.]+ (KiB|MiB|GiB) alone \(out of memory alone\); lower"):
        engine.generate([LONG], engine.params(SETTINGS))


def test_through_the_queue_only_the_row_too_large_alone_fails_with_too_large(tmp_path: Path, fragile) -> None:  # type: ignore[no-untyped-def]
    engine, alone = fragile
    lines = [{"custom_id": f"r{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    lines.insert(3, {"custom_id": "big", "prompt": LONG})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    backend = EngineBackend.__new__(EngineBackend)  # the fragile engine, loaded once
    backend.engine, backend.base = engine, engine.params(SETTINGS)
    run_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "failed.jsonl", LocalExecutor(backend, 16))
    [failure] = map(json.loads, (tmp_path / "failed.jsonl").open())
    assert failure["custom_id"] == "big" and failure["code"] == "too_large" and "needs about" in failure["message"]
    got = {r["custom_id"]: r["response"]["body"]["text"] for r in map(json.loads, (tmp_path / "out.jsonl").open())}
    assert got == {f"r{i}": alone[p] for i, p in enumerate(PROMPTS)}


def test_back_off_keeps_the_rows_order_and_fails_only_the_row_over_the_budget() -> None:
    runs: list[list[int]] = []

    def run(group: list[int]) -> list[int]:
        runs.append(group)
        if len(group) > 3:
            raise torch.OutOfMemoryError("fake")
        return [10 * r for r in group]

    need = lambda group: 100 * max(group)  # noqa: E731  (row 9 alone is over the budget)
    out = run_backing_off(run, [1, 2, 3, 9, 4, 5, 6, 7], need=need, budget=800)
    assert [o.value for o in out] == [10, 20, 30, None, 40, 50, 60, 70]
    assert isinstance(out[3].error, TooLarge) and "needs about 900 B alone (over the budget of 800 B)" in str(
        out[3].error
    )
    assert runs == [[1, 2, 3], [4, 5, 6, 7], [4, 5], [6, 7]]  # the largest group within budget; 9 never runs


def test_back_off_passes_other_errors_through() -> None:
    def run(group: list[int]) -> list[int]:
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        run_backing_off(run, [1, 2])


def test_isolated_a_row_that_fails_alone_is_its_own_outcome_and_its_batch_mates_answer() -> None:
    """`isolate` (serve's static batches): any failure halves the batch down to the row that raises alone; rows
    already answered are kept, not decoded again."""
    runs: list[list[int]] = []

    def run(group: list[int]) -> list[int]:
        runs.append(group)
        if 5 in group:
            raise ValueError("row 5 is bad")
        return [10 * r for r in group]

    out = run_backing_off(run, [1, 2, 3, 4, 5, 6], isolate=True)
    assert [o.value for o in out] == [10, 20, 30, 40, None, 60]
    assert isinstance(out[4].error, ValueError) and str(out[4].error) == "row 5 is bad"
    assert runs == [[1, 2, 3, 4, 5, 6], [1, 2, 3], [4, 5, 6], [4], [5, 6], [5], [6]]


@pytest.fixture()
def fragile_block(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path):  # type: ignore[no-untyped-def]
    """A block-causal model (the running set's path) that runs out of memory over 2 rows or 40 positions."""
    from .conftest import make_model

    folder = make_model(tmp_path_factory.mktemp("oomblk") / "m", tiny_tokenizer, seed=4, block_causal=True)
    engine = load_engine(folder, device="cpu", dtype="float32")
    params = engine.params({"strategy": "block-fast", **SETTINGS})
    assert engine.continuous(params)
    alone = {p: engine.generate([p], params)[0].text for p in PROMPTS}
    engine.model = OutOfMemoryAbove(engine.model, rows=2, width=40)  # type: ignore[assignment]
    return engine, params, alone


def test_the_running_set_out_of_memory_narrows_and_every_row_answers_as_alone(fragile_block) -> None:  # type: ignore[no-untyped-def]
    engine, params, alone = fragile_block
    results = engine.generate(PROMPTS, params, batch_size=6)
    assert [r.text for r in results] == [alone[p] for p in PROMPTS]
    assert max(rows for rows, _ in engine.model.shapes) == 6  # six rows in flight were tried first


def test_the_running_set_fails_only_the_row_too_large_alone(fragile_block) -> None:  # type: ignore[no-untyped-def]
    engine, params, alone = fragile_block
    answered: dict[int, str] = {}
    prompts = [*PROMPTS[:3], LONG, *PROMPTS[3:]]  # its prompt's prefill is over 40 positions
    encoded = [engine.encode_prompt(p) for p in prompts]
    with pytest.raises(TooLarge, match=r"needs about [\d.]+ (KiB|MiB|GiB) alone \(out of memory alone\)"):
        engine.decode_running(
            prompts, encoded, [params] * len(prompts), [params.seed] * len(prompts), 4,
            lambda i, r: answered.__setitem__(i, r.text),
        )  # fmt: skip
    assert answered == {i: alone[p] for i, p in enumerate(prompts) if p != LONG}
