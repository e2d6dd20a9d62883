"""What the reporting commands print: bench's table whole when piped, eval's table or JSON (not both),
status without Python's None."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from celeris_cli.cli import app

from .spool_helpers import make_queue

runner = CliRunner()
SMALL = ["--device", "cpu", "--batch-size", "2"]


def test_bench_table_keeps_whole_names_when_piped(tiny_model: Path) -> None:
    args = ["bench", "--model", str(tiny_model), "--prompts", "2", "--gen-length", "8", "--block-length", "8",
            "--modes", "reference,threshold+exit,dual-cache", "--no-agreement", *SMALL]  # fmt: skip
    r = runner.invoke(app, args)  # CliRunner's stdout is not a terminal, like a pipe
    assert r.exit_code == 0, r.output
    assert "…" not in r.stdout
    for name in ("reference", "threshold+exit", "dual-cache", "tokens/s", "distinct-2", "of raw fwd"):
        assert name in r.stdout


def test_eval_prints_a_table_or_json_not_both(tiny_model: Path) -> None:
    args = ["eval", "--model", str(tiny_model), "--poems", "2", "--english", "1", "--no-nll",
            "--set", '{"gen_length": 8, "block_length": 8}', *SMALL]  # fmt: skip
    table = runner.invoke(app, args, terminal_width=120)
    assert table.exit_code == 0, table.output
    assert "structure_rate" in table.stdout and not any(line.startswith("{") for line in table.stdout.splitlines())
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["poems"] == 2  # the whole stdout is one JSON document


def test_status_prints_a_dash_where_there_is_nothing(tmp_path: Path) -> None:
    config = make_queue(tmp_path)
    r = runner.invoke(app, ["status", str(config)], terminal_width=120)
    assert r.exit_code == 0, r.output
    assert "None" not in r.stdout and "none" not in r.stdout
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.stdout.splitlines() if line.count("│") == 3
    }
    assert rows["oldest pending (s)"] == "-" and rows["lock holder"] == "-" and rows["last heartbeat"] == "-"
