"""`scripts/mask-cost`: the synthetic vocabulary is the size asked and spells every answer, each answer is valid
for its schema, and each engine computes one mask per answer token and one after the last (on a small
vocabulary: the script's own figures are not checked, only what it counts)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path
from typing import Any

import jsonschema

from celeris_cli.measure.structured import SCHEMAS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mask-cost"


def _script() -> Any:
    loader = SourceFileLoader("mask_cost", str(SCRIPT))
    spec = importlib.util.spec_from_loader("mask_cost", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_vocabulary_is_the_size_asked_distinct_and_deterministic() -> None:
    script = _script()
    vocab = script.synthetic_vocabulary(150_000)
    assert len(vocab) == 150_000 and len(set(vocab)) == 150_000 and vocab[-1] == b""
    assert vocab == script.synthetic_vocabulary(150_000)
    assert vocab[:256] == [bytes([b]) for b in range(256)]  # every byte: any text can be spelt


def test_runs_every_schema_on_each_engine_one_mask_per_token_and_one_after() -> None:
    script = _script()
    vocab = script.synthetic_vocabulary(3000)
    tokens = script.Tokens(vocab)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--vocab", "3000", "--repeats", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    header, *rows = (json.loads(line) for line in done.stdout.splitlines())
    assert header["vocab"] == 3000 and header["repeats"] == 2
    engines = {r["engine"] for r in rows}
    assert "llguidance" in engines and engines <= {"llguidance", "xgrammar"}
    schemas = {**SCHEMAS, "text": script.TEXT}
    for name, schema in schemas.items():
        jsonschema.validate(script.ANSWERS[name], schema)
        answer = tokens.wrapper(json.dumps(script.ANSWERS[name], separators=(",", ":")))
        for r in rows:
            if r["schema"] == name:
                assert r["masks"] == 2 * (len(answer) + 1), r
                assert r["agree"] is None or 0 <= r["agree"] <= len(answer) + 1
    for engine in engines:
        every = [r for r in rows if r["engine"] == engine and r["schema"] == "all"]
        assert len(every) == 1 and every[0]["masks"] == sum(
            r["masks"] for r in rows if r["engine"] == engine and r["schema"] != "all"
        )


def test_refuses_a_vocabulary_out_of_bounds() -> None:
    for size in ("10", "2000000"):
        done = subprocess.run([sys.executable, str(SCRIPT), "--vocab", size], capture_output=True, text=True)
        assert done.returncode == 2 and "--vocab must be" in done.stderr
