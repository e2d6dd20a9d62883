"""`--max-memory` below one row: a row whose own estimate is over the budget is never admitted to the running
set; it fails alone with `too_large` (generate exits 1, the queue writes its failure record) and every other
row gets the answer it gets alone. A size without a unit is a usage error wherever a size is taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.arch.memory import parse_size
from celeris_cli.batch import run_file
from celeris_cli.batch.local import LocalExecutor
from celeris_cli.cli import app
from celeris_cli.errors import ConfigError, TooLarge, UsageError
from celeris_cli.spool.backend import EngineBackend
from celeris_cli.spool.config import parse_config

from .conftest import make_model

PROMPTS = ["the cat", "a dog ran far", "one", "birds sing in the morning"]
LONG = "the long one " * 12
SETTINGS = {"strategy": "block-fast", "gen_length": 16, "denoise_steps": 8, "block_length": 8}
FAST = ["--gen-length", "8", "--block-length", "8", "--denoise-steps", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def block_model(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Path:
    return make_model(tmp_path_factory.mktemp("budget") / "m", tiny_tokenizer, seed=4, block_causal=True)


@pytest.fixture(scope="module")
def capped(block_model: Path):  # type: ignore[no-untyped-def]
    """An engine whose budget fits each short prompt alone but not LONG alone, and the answers alone."""
    free = load_engine(block_model, device="cpu", dtype="float32")
    params = free.params(SETTINGS)
    assert free.continuous(params)  # the running set's path
    alone = {p: free.generate([p], params)[0].text for p in PROMPTS}
    short = max(free.memory.need([free.encode_prompt(p)], params) for p in PROMPTS)
    assert free.memory.need([free.encode_prompt(LONG)], params) > short
    engine = load_engine(block_model, device="cpu", dtype="float32", max_memory=f"{short}B")
    return engine, params, alone


def test_decode_running_fails_the_row_over_the_budget_alone_and_answers_the_others(capped) -> None:  # type: ignore[no-untyped-def]
    engine, params, alone = capped
    prompts = [*PROMPTS[:2], LONG, *PROMPTS[2:]]
    answered: dict[int, str] = {}
    with pytest.raises(TooLarge, match=r"needs about .* alone \(over the budget of .*\); lower"):
        engine.decode_running(
            prompts, [engine.encode_prompt(p) for p in prompts], [params] * len(prompts),
            [params.seed] * len(prompts), 4, lambda i, r: answered.__setitem__(i, r.text),
        )  # fmt: skip
    assert answered == {i: alone[p] for i, p in enumerate(prompts) if p != LONG}


def test_through_the_queue_the_row_over_the_budget_gets_a_too_large_record(tmp_path: Path, capped) -> None:  # type: ignore[no-untyped-def]
    engine, params, alone = capped
    lines = [{"custom_id": f"r{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    lines.insert(2, {"custom_id": "big", "prompt": LONG})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    backend = EngineBackend.__new__(EngineBackend)  # the capped engine, loaded once
    backend.engine, backend.base = engine, params
    run_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "failed.jsonl", LocalExecutor(backend, 16))
    [failure] = map(json.loads, (tmp_path / "failed.jsonl").open())
    assert failure["custom_id"] == "big" and failure["code"] == "too_large" and "over the budget" in failure["message"]
    got = {r["custom_id"]: r["response"]["body"]["text"] for r in map(json.loads, (tmp_path / "out.jsonl").open())}
    assert got == {f"r{i}": alone[p] for i, p in enumerate(PROMPTS)}


def test_generate_below_one_row_exits_1_with_too_large(block_model: Path) -> None:
    r = CliRunner().invoke(
        app, ["generate", "--model", str(block_model), "--prompt", "床前明月光，", "--max-memory", "1KB", *FAST]
    )  # fmt: skip (a tiny model)
    assert r.exit_code == 1, r.output
    assert "too large for this device's memory" in r.output and "over the budget of" in r.output


@pytest.mark.parametrize("size", ["2", "512", "1.5"])
def test_a_size_without_its_unit_is_a_usage_error(size: str, block_model: Path) -> None:
    with pytest.raises(UsageError, match="needs its unit"):
        parse_size(size)
    r = CliRunner().invoke(app, ["generate", "--model", str(block_model), "--prompt", "x", "--max-memory", size])
    assert r.exit_code == 2 and "needs its unit" in r.output, r.output
    with pytest.raises(ConfigError, match="max_memory must be a size .* needs its unit"):
        parse_config({"max_memory": size}, Path("batch.yaml"))
    assert parse_size(f"{size}B") == int(float(size))  # with the unit, bytes
