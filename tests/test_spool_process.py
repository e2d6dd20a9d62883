"""Crash, signal and lock behaviour of the queue, with real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from celeris_cli.spool.fsutil import CRASH_ENV, CRASH_EXIT

from .spool_helpers import claimed, drop, failures, make_queue, outputs, visible

REPO = Path(__file__).parents[1]


def spawn(config: Path, *args: str, crash: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.Popen(
        [sys.executable, "-m", "tests.run_spool", str(config), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(config: Path, *args: str, crash: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    p = spawn(config, *args, crash=crash)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def celeris(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real `celeris` CLI in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(CRASH_ENV, None)
    return subprocess.run(
        [sys.executable, "-m", "celeris_cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def populate(root: Path) -> set[str]:
    """Three files, one with a bad line, so every crash point is on the path. Returns all input ids."""
    drop(root, "a.txt", "one\ntwo\nthree\n", age_s=30)
    lines = [json.dumps({"id": f"j{i}", "prompt": f"p{i}"}) for i in range(5)] + ["{broken"]
    drop(root, "b.jsonl", "\n".join(lines) + "\n", age_s=20)
    drop(root, "c.txt", "".join(f"c{i}\n" for i in range(20)), age_s=10)
    return (
        {f"a.txt:line-{i}" for i in (1, 2, 3)}
        | {f"b.jsonl:j{i}" for i in range(5)}
        | {"b.jsonl:line-6"}
        | {f"c.txt:line-{i}" for i in range(1, 21)}
    )


def accounted(root: Path) -> list[str]:
    """Every id with an output line or a failure record, duplicates kept."""
    ids = [
        f"{name.removesuffix('.results.jsonl')}:{rec['custom_id']}"
        for name, recs in outputs(root).items()
        for rec in recs
    ]
    ids += [
        f"{rec['source']['file']}:{rec['custom_id'] or 'line-' + str(rec['source']['line'])}" for rec in failures(root)
    ]
    return ids


CRASH_POINTS = [
    "after_claim",
    "mid_batch",
    "after_failure_append",
    "mid_failure_append",
    "after_output_tmp",
    "after_publish",
    "after_late_watch",
    "after_move",
]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_at_each_point_then_restart_loses_and_duplicates_nothing(tmp_path: Path, point: str) -> None:
    config = make_queue(tmp_path, batch_size=4)
    expected = populate(tmp_path)
    crashed = run(config, "--once", crash=point)
    assert crashed.returncode == CRASH_EXIT, crashed.stderr  # it really died at that point
    b_finished_before = (tmp_path / "batch_processed" / "b.jsonl").exists()
    again = run(config, "--once")
    # 1 when this run finished the file with the broken line; 0 when the crashed run had finished it
    assert again.returncode == (0 if b_finished_before else 1), again.stderr
    ids = accounted(tmp_path)
    assert sorted(ids) == sorted(expected)  # each id exactly once: an output line or a failure record
    assert claimed(tmp_path) == []
    visible_tmp = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert visible_tmp == []
    assert visible(tmp_path / "batch_processed") == [
        "a.txt",
        "b.jsonl",
        "c.txt",
    ]


def test_sigterm_finishes_the_batch_in_flight_keeps_the_file_claimed_and_exits_0(tmp_path: Path) -> None:
    config = make_queue(tmp_path, batch_size=2, shutdown_grace_s=20)
    drop(tmp_path, "slow.txt", "".join(f"q{i}\n" for i in range(6)))
    p = spawn(config, "--delay", "0.5")
    wait_for(lambda: bool(claimed(tmp_path)))
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    done = (tmp_path / "batch_processed" / "slow.txt").exists()
    kept = bool(claimed(tmp_path))  # unfinished: it stays claimed, with its journal, for the next start
    assert done != kept and not (tmp_path / "batch_inputs" / "slow.txt").exists()
    if kept:  # a later run serves it completely
        assert run(config, "--once").returncode == 0
    assert len(outputs(tmp_path)["slow.txt.results.jsonl"]) == 6


def test_second_signal_exits_at_once_and_restart_recovers(tmp_path: Path) -> None:
    config = make_queue(tmp_path, batch_size=1, shutdown_grace_s=60)
    drop(tmp_path, "slow.txt", "".join(f"q{i}\n" for i in range(5)))
    p = spawn(config, "--delay", "2")
    wait_for(lambda: bool(claimed(tmp_path)))
    p.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=10)
    assert p.returncode == 128 + signal.SIGTERM
    assert run(config, "--once").returncode == 0
    assert len(outputs(tmp_path)["slow.txt.results.jsonl"]) == 5


def test_second_instance_exits_75_and_status_names_the_holder(tmp_path: Path) -> None:
    config = make_queue(tmp_path)
    first = spawn(config)
    try:
        wait_for(lambda: (tmp_path / "logs" / "heartbeat.json").exists())
        second = run(config, "--once")
        assert second.returncode == 75 and "lock" in second.stderr
        cli = celeris("watch", str(config), "--once")
        assert cli.returncode == 75 and "another celeris instance holds the queue lock" in cli.stderr
        st = celeris("status", str(config), "--json")
        assert json.loads(st.stdout)["lock_holder"] == f"pid {first.pid}"
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0


def test_files_present_before_start_and_files_without_events_are_served(tmp_path: Path) -> None:
    config = make_queue(tmp_path, rescan_s=0.3)
    drop(tmp_path, "before.txt", "early\n")
    p = spawn(config, "--no-watchdog")  # no events at all: only the periodic rescan can find new files
    try:
        wait_for(lambda: (tmp_path / "batch_processed" / "before.txt").exists())
        drop(tmp_path, "after.txt", "late\n")
        wait_for(lambda: (tmp_path / "batch_processed" / "after.txt").exists())
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert set(outputs(tmp_path)) == {"before.txt.results.jsonl", "after.txt.results.jsonl"}


def test_watch_once_with_the_real_engine_end_to_end(tmp_path: Path, tiny_model: Path) -> None:
    config = make_queue(tmp_path, model=tiny_model, output_formats=["jsonl", "txt"])
    drop(
        tmp_path,
        "real.jsonl",
        json.dumps({"id": "r1", "prompt": "床前明月光，", "denoise_steps": 2})
        + "\n"
        + json.dumps({"id": "r2", "prompt": "x", "denoise_steps": "two"})
        + "\n"
        + json.dumps({"id": "r3", "prompt": "x", "min_p": 1.5})
        + "\n"
        + json.dumps({"custom_id": "r4", "body": {"prompt": "春", "min_p": 0.05, "temperature": 1.0}})
        + "\n",
    )
    p = celeris("watch", str(config), "--once")
    assert p.returncode == 1, p.stderr
    r1, r4 = outputs(tmp_path)["real.jsonl.results.jsonl"]
    body = r1["response"]["body"]
    assert r1["custom_id"] == "r1" and body["settings"]["denoise_steps"] == 2 and body["timing"]["nfe"] == 2
    assert body["usage"]["completion_tokens"] <= 8
    settings = r4["response"]["body"]["settings"]
    assert r4["custom_id"] == "r4" and (settings["min_p"], settings["temperature"]) == (0.05, 1.0)
    fails = {f["custom_id"]: f for f in failures(tmp_path)}
    assert set(fails) == {"r2", "r3"} and {f["code"] for f in fails.values()} == {"bad_param"}
    assert "denoise_steps must be an integer" in fails["r2"]["message"]
    assert "min_p must be in [0, 1)" in fails["r3"]["message"]
    assert (tmp_path / "batch_outputs" / "real.jsonl.results.txt").read_text().startswith("[r1]")


def test_watch_reports_config_errors_with_exit_2(tmp_path: Path) -> None:
    config = make_queue(tmp_path, batch_size="lots")
    p = celeris("watch", str(config), "--once")
    assert p.returncode == 2 and p.stderr.strip() == "Error: batch_size: must be int, got 'lots'"
