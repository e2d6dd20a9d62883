"""Every command follows the README's exit-code table: 0 success, 1 some requests failed, 2 usage or
config error, 75 lock held, 130 interrupted. Each documented error is run here and its code checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app
from celeris_cli.errors import EXIT_FAILED, EXIT_LOCKED, EXIT_OK, EXIT_USAGE

from .spool_helpers import make_queue

runner = CliRunner()

# (case, argv with {tmp} for a scratch folder, stdin); every one of these must exit 2 without a traceback
USAGE_ERRORS = [
    ("unknown command", ["warp"], None),
    ("generate: no prompt", ["generate"], ""),
    ("generate: --json and --jsonl", ["generate", "x", "--json", "--jsonl"], None),
    ("generate: unreadable --file", ["generate", "--file", "{tmp}/missing.txt"], None),
    ("generate: a count of 0", ["generate", "x", "--denoise-steps", "0"], None),
    ("generate: unknown choice", ["generate", "x", "--strategy", "warp"], None),
    ("generate: missing model", ["generate", "x", "--model", "{tmp}/nope"], None),
    ("batch: missing input", ["batch", "-i", "{tmp}/missing.jsonl", "-o", "{tmp}/out.jsonl"], None),
    ("batch: bad --set", ["batch", "-i", "{tmp}/in.txt", "-o", "{tmp}/out.jsonl", "--set", "{{"], None),
    ("watch: missing config", ["watch", "{tmp}/missing.yaml", "--once"], None),
    ("retry: missing log", ["retry", "{tmp}/missing.jsonl", "--config", "{tmp}/configs/batch.yaml"], None),
    ("retry: not a failure log", ["retry", "{tmp}/in.txt", "--config", "{tmp}/configs/batch.yaml"], None),
    ("status: missing config", ["status", "{tmp}/missing.yaml"], None),
    ("train: no corpus", ["train", "--corpus", "{tmp}/nope", "--out", "{tmp}/run"], None),
    ("eval: --set not an object", ["eval", "--set", "[1]"], None),
    ("eval: missing model", ["eval", "--model", "{tmp}/nope"], None),
    ("bench: unknown mode", ["bench", "--modes", "warp"], None),
    ("bench: bad sweep", ["bench", "sweep", "a,b"], None),
    ("bench: an old flag", ["bench", "--workload", "mixed"], None),
    ("bench: bad --set", ["bench", "--set", "{{"], None),
]


@pytest.mark.parametrize(("case", "argv", "stdin"), USAGE_ERRORS, ids=[c[0] for c in USAGE_ERRORS])
def test_usage_and_config_errors_exit_2(tmp_path: Path, case: str, argv: list[str], stdin: str | None) -> None:
    make_queue(tmp_path)
    (tmp_path / "in.txt").write_text("hello\n", encoding="utf-8")
    r = runner.invoke(app, [a.format(tmp=tmp_path) for a in argv], input=stdin)
    assert r.exit_code == EXIT_USAGE, (case, r.output)
    assert "Traceback" not in r.output


def test_generate_exits_0_when_all_answered_and_1_when_a_line_failed(tiny_model: Path, tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("床前\n" + "床" * 400 + "\n", encoding="utf-8")
    base = ["generate", "--model", str(tiny_model), "--gen-length", "4", "--block-length", "4", "--device", "cpu"]
    assert runner.invoke(app, [*base, "床前"]).exit_code == EXIT_OK
    assert runner.invoke(app, [*base, "--file", str(f)]).exit_code == EXIT_FAILED


def test_watch_and_retry_report_a_held_lock(tmp_path: Path) -> None:
    from celeris_cli.spool.config import load_config
    from celeris_cli.spool.daemon import queue_lock

    config = make_queue(tmp_path)
    lock = queue_lock(load_config(config))
    lock.acquire()
    try:
        r = runner.invoke(app, ["watch", str(config), "--once"])
        assert r.exit_code == EXIT_LOCKED and "holds the queue lock" in r.stderr
    finally:
        lock.release()


def test_retry_that_queues_nothing_exits_0(tmp_path: Path) -> None:
    config = make_queue(tmp_path)
    log = tmp_path / "logs" / "failed.jsonl"
    log.write_text(json.dumps({"key": "k", "retryable": False, "attempt": 1, "request": None}) + "\n")
    r = runner.invoke(app, ["retry", str(log), "--config", str(config)])
    assert r.exit_code == EXIT_OK, r.output


def test_version_exits_0() -> None:
    assert runner.invoke(app, ["--version"]).exit_code == EXIT_OK


@pytest.mark.parametrize("pattern, code", [("[a-z]{40}", EXIT_FAILED), ("[a-z]{4}", EXIT_OK)])
def test_a_constrained_answer_that_ends_with_an_error_exits_1(pattern: str, code: int) -> None:
    """An answer that reached its length before its constraint was complete is written, with its `error`,
    and the command exits 1 (some requests failed), as a skipped line does; one that completes exits 0."""
    argv = ["generate", "--prompt", "x", "--regex", pattern, "--gen-length", "8", "--jsonl", "--strategy", "spec"]
    r = runner.invoke(app, [*argv, "--device", "cpu", "--dtype", "float32"])
    (answer,) = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.exit_code == code, r.output
    assert (answer["error"] is not None) == (code == EXIT_FAILED) and "Traceback" not in r.output
    assert ("ended with an error" in r.stderr) == (code == EXIT_FAILED)
