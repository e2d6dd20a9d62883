"""Stops and kills of the whole daemon are no evidence against the requests in flight (issue 46): with
real daemon processes over a slow fake model, three SIGKILLs and three stops whose grace ran out, each
with the same valid rows in flight, leave every row answered and none `poison`; a row that kills the
process whenever it is decoded is still found. And a stop says what it kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from .spool_helpers import claimed, drop, failures, make_queue, outputs
from .test_spool_process import REPO, run, spawn, wait_for

LINES = "".join(f"valid {i}\n" for i in range(6))


def decoding(root: Path, p: subprocess.Popen[str]) -> bool:
    """The daemon `p` has a batch in flight (its heartbeat says so)."""
    heartbeat = root / "logs" / "heartbeat.json"
    try:
        hb = json.loads(heartbeat.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet, or mid-rename
        return False
    return bool(hb.get("pid") == p.pid and hb.get("state") == "decoding")


def in_flight_lines(root: Path) -> list[set[int]]:
    """For each claim of the one claimed file, the lines its journal says were about to be decoded."""
    [journal] = (root / "batch_inputs" / ".work" / "journal").glob("*.jsonl")
    claims: list[set[int]] = [set()]
    for raw in journal.read_text().splitlines():
        rec = json.loads(raw)
        if "claim" in rec and "try" not in rec:
            claims.append(set())
        claims[-1].update(rec.get("try", []))
    return claims


def test_three_sigkills_with_the_same_rows_in_flight_poison_nothing(tmp_path: Path) -> None:
    config = make_queue(tmp_path, batch_size=4)  # max_claims: the default, 3
    drop(tmp_path, "v.txt", LINES)
    for _ in range(3):
        p = spawn(config, "--delay", "30")
        wait_for(lambda p=p: decoding(tmp_path, p))  # type: ignore[misc]
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=10)
    tried = in_flight_lines(tmp_path)
    assert len(tried) == 3 and tried[1] & tried[2]  # the same line was in flight, alone, at two of the kills
    done = run(config, "--once")
    assert done.returncode == 0, done.stderr
    assert [r["custom_id"] for r in outputs(tmp_path)["v.txt.results.jsonl"]] == [f"line-{i}" for i in range(1, 7)]
    assert failures(tmp_path) == []


def test_three_stops_whose_grace_ran_out_poison_nothing_and_say_what_they_kept(tmp_path: Path) -> None:
    config = make_queue(tmp_path, batch_size=4, shutdown_grace_s=0.2)
    drop(tmp_path, "v.txt", LINES)
    for _ in range(3):
        p = spawn(config, "--delay", "30", "--hooks")
        wait_for(lambda p=p: decoding(tmp_path, p))  # type: ignore[misc]
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        lines = err.strip().splitlines()
        assert lines[0].startswith(f"celeris watch: watching {tmp_path / 'batch_inputs'}"), err
        assert "shutdown_grace_s (0.2 s) ran out; kept claimed 1 file: v.txt (4 in flight); 4 requests" in lines[-1]
        assert "resume on the next start" in lines[-1]
    assert len(claimed(tmp_path)) == 1
    done = run(config, "--once")
    assert done.returncode == 0, done.stderr
    assert [r["custom_id"] for r in outputs(tmp_path)["v.txt.results.jsonl"]] == [f"line-{i}" for i in range(1, 7)]
    assert failures(tmp_path) == []


def test_a_row_that_kills_the_process_whenever_it_decodes_is_poison_and_the_rest_answered(tmp_path: Path) -> None:
    config = make_queue(tmp_path, batch_size=4)  # max_claims: the default, 3
    drop(tmp_path, "d.txt", "ok 1\nok 2\ndie 3\nok 4\nok 5\nok 6\n")
    codes = []
    while not codes or codes[-1] == -signal.SIGKILL and len(codes) < 10:
        codes.append(run(config, "--once", "--die-on", "die").returncode)
    # the first death is an ordinary batch's (no evidence); its rows are tested together, and a test that
    # dies is halved (no evidence either) until the row is tested alone; then three deaths alone
    assert codes[-1] == 1 and set(codes[:-1]) == {-signal.SIGKILL}, codes
    assert 1 + 3 < len(codes) - 1 <= 1 + 2 + 3, codes  # log2 of the 4 rows in flight: at most 2 halvings
    out = outputs(tmp_path)["d.txt.results.jsonl"]
    assert [r["custom_id"] for r in out] == ["line-1", "line-2", "line-4", "line-5", "line-6"]
    [rec] = failures(tmp_path)
    assert rec["code"] == "poison" and rec["custom_id"] == "line-3"


def test_watch_says_when_it_is_up_and_watching_before_any_batch(tmp_path: Path) -> None:
    # the embedded model (its own settings: it drafts, it has no blocks), an empty inbox: no batch will come
    config = make_queue(tmp_path, generation={"gen_length": 8, "denoise_steps": 4})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    heartbeat = tmp_path / "logs" / "heartbeat.json"
    with open(tmp_path / "stderr.txt", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "celeris_cli", "watch", str(config)], env=env, stderr=err)
    try:
        wait_for(lambda: heartbeat.exists() and json.loads(heartbeat.read_text())["pid"] == p.pid, timeout=120)
        said = (tmp_path / "stderr.txt").read_text()  # the loop is running: the line came before it
        assert said == f"celeris watch: watching {tmp_path / 'batch_inputs'} (model embedded default, pid {p.pid})\n"
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    said = (tmp_path / "stderr.txt").read_text().splitlines()
    assert p.returncode == 0 and said[-1].startswith("celeris watch: stopped on SIGTERM (0 files"), said
