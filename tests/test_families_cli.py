"""Each family through the faces users touch: `celeris inspect`, `generate --chat`, and the queue with
OpenAI chat lines, on the tiny folders saved by each family's own code (tests/data/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app

from .spool_helpers import drop, failures, make_queue, outputs

REPO = Path(__file__).parents[1]
DATA = Path(__file__).parent / "data"
FOLDERS = {
    "llada": DATA / "llada_hf",
    "dream": DATA / "dream" / "dream_tiny",
    "llada2_moe": DATA / "llada2" / "llada2_tiny",
}
END_OF_TURN = {"llada": "<|eot_id|>", "dream": "<|im_end|>", "llada2_moe": "<|role_end|>"}


def celeris(*args: str, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "celeris_cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def inspect_json(folder: Path) -> dict[str, Any]:
    """`celeris inspect FOLDER --json`, in process (the subprocess path is the generate and watch tests')."""
    r = CliRunner().invoke(app, ["inspect", str(folder), "--json"])
    assert r.exit_code == 0, r.output
    info: dict[str, Any] = json.loads(r.stdout)
    return info


@pytest.mark.parametrize("family", FOLDERS)
def test_inspect_names_the_architecture_special_ids_and_strategies(family: str) -> None:
    info = inspect_json(FOLDERS[family])
    assert info["architecture"].startswith(family)
    assert END_OF_TURN[family] in info["special_ids"]["end_of_turn"]
    assert info["chat_template"] == "yes"
    assert int(info["parameters"].replace(",", "")) > 100_000


def test_inspect_of_an_unknown_model_type_lists_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    p = celeris("inspect", str(tmp_path))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "'mamba' is not supported" in p.stderr and "Dream" in p.stderr and "llada2_moe" in p.stderr


@pytest.mark.parametrize("family", ["dream", "llada2_moe"])
def test_generate_chat_renders_the_familys_template_and_stops_at_its_end_of_turn(family: str) -> None:
    p = celeris(
        "generate", "--model", str(FOLDERS[family]), "--chat", "--prompt", "What is 2 + 3?",
        "--gen-length", "32", "--temperature", "0", "--json", "--quiet", "--dtype", "float32",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert END_OF_TURN[family] not in r["text"]
    assert r["prompt_tokens"] > len("What is 2 + 3?".split())  # the template's tokens were added


@pytest.mark.parametrize("family", ["dream", "llada2_moe"])
def test_the_queue_answers_openai_chat_lines_with_each_family(tmp_path: Path, family: str) -> None:
    chat = {"messages": [{"role": "user", "content": "What is 3 plus 4?"}], "max_tokens": 16, "temperature": 0}
    plain = {"prompt": "def add(a, b):", "max_tokens": 16}
    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "p1", "method": "POST", "url": "/v1/completions", "body": plain},
    ]
    steps = {"block_steps": 4} if family == "llada2_moe" else {"denoise_steps": 8}
    config = make_queue(tmp_path, model=FOLDERS[family], batch_size=4, generation={"block_length": 8, **steps})
    drop(tmp_path, "in.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    p = celeris("watch", str(config), "--once")
    assert p.returncode == 0, p.stderr
    rows = {r["custom_id"]: r["response"] for r in outputs(tmp_path)["in.jsonl.results.jsonl"]}
    assert set(rows) == {"c1", "p1"}
    assert all(r["status_code"] == 200 for r in rows.values())
    strategy = "block-fast" if family == "llada2_moe" else "fast"
    assert rows["c1"]["body"]["settings"]["strategy"] == strategy


def test_a_queue_request_for_a_strategy_the_model_does_not_run_fails_alone_by_name(tmp_path: Path) -> None:
    plain = {"prompt": "def add(a, b):", "max_tokens": 16}
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": plain},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {**plain, "strategy": "fast"}},
    ]
    config = make_queue(tmp_path, model=FOLDERS["llada2_moe"], generation={"block_length": 8})
    drop(tmp_path, "in.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    p = celeris("watch", str(config), "--once")
    assert p.returncode == 1, p.stderr  # --once exits 1 when a request failed
    assert [r["custom_id"] for r in outputs(tmp_path)["in.jsonl.results.jsonl"]] == ["ok"]
    [failure] = failures(tmp_path)
    assert failure["custom_id"] == "bad" and failure["code"] == "bad_param" and not failure["retryable"]
    assert "does not run on the llada2_moe architecture" in failure["message"]
