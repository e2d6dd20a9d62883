"""Hostile faults with real subprocesses: a name with a newline across SIGTERM and restart, concurrent
`celeris retry`, folders deleted under a running daemon, a prompt SIGTERM of an idle daemon."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .spool_helpers import claimed, drop, failures, make_queue, outputs, visible
from .test_spool_process import REPO, run, spawn, wait_for


def test_a_name_with_a_newline_survives_sigterm_and_restart_as_itself(tmp_path: Path) -> None:
    config = make_queue(tmp_path, shutdown_grace_s=0.2)
    drop(tmp_path, "new\nline.txt", "first\nhang here\n")
    p = spawn(config, "--hang-on", "hang")
    wait_for(lambda: bool(claimed(tmp_path)))
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert claimed(tmp_path) == ["00000001.new\nline.txt"]
    for _ in range(2):  # a restart that stops again must not rename it either
        assert run(config, "--once", "--hang-on", "nothing").returncode == 0
    assert list(outputs(tmp_path)) == ["new\nline.txt.results.jsonl"]
    assert len(outputs(tmp_path)["new\nline.txt.results.jsonl"]) == 2 and failures(tmp_path) == []
    assert claimed(tmp_path) == [] and visible(tmp_path / "batch_processed") == ["new\nline.txt"]


def test_folders_deleted_under_a_running_daemon_are_created_again_and_it_serves_on(tmp_path: Path) -> None:
    config = make_queue(tmp_path, rescan_s=0.1)
    drop(tmp_path, "before.txt", "first\n")
    p = spawn(config)
    try:
        wait_for(lambda: (tmp_path / "batch_processed" / "before.txt").exists())
        for folder in ("batch_inputs", "batch_outputs", "logs"):  # gone at once: renamed away, then deleted
            # (deleted in place, a daemon rescanning every 0.1 s may write into it mid-delete: ENOTEMPTY)
            (tmp_path / folder).rename(tmp_path / f"{folder}.gone")
            shutil.rmtree(tmp_path / f"{folder}.gone")
        wait_for(lambda: (tmp_path / "batch_inputs" / ".work").is_dir() and (tmp_path / "logs").is_dir())
        drop(tmp_path, "after.txt", "second\n")
        wait_for(lambda: (tmp_path / "batch_processed" / "after.txt").exists())
        assert p.poll() is None  # still serving
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "after.txt.results.jsonl" in outputs(tmp_path)
    for key in ("inputs", "outputs", "logs"):
        assert f"({key}) was missing; created it again" in err


def test_two_retries_at_the_same_instant_both_succeed_and_resubmit_each_record_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(3):
        root = tmp_path / f"r{round_}"
        config = make_queue(root, max_attempts=3)
        log = root / "logs" / "failed.jsonl"
        recs = [
            {"key": f"1/a.jsonl:{i}:1", "code": "engine_error", "retryable": True, "attempt": 1,
             "custom_id": f"c{i}", "output": "a.jsonl.results.jsonl", "request": {"custom_id": f"c{i}", "prompt": "p"}}
            for i in range(300)
        ]  # fmt: skip
        log.write_text("".join(json.dumps(r) + "\n" for r in recs))
        cmd = [sys.executable, "-m", "celeris_cli", "retry", str(log), "--config", str(config), "--no-run", "--json"]
        procs = [
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in (1, 2)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        reports = [json.loads(out) for out, _ in outs]
        assert sorted(r["resubmitted"] for r in reports) == [0, 300]
        assert sum(r["already_retried"] for r in reports) == 300
        inbox = [p for p in (root / "batch_inputs").iterdir() if p.is_file() and not p.name.startswith(".")]
        assert len(inbox) == 1 and len(inbox[0].read_text().splitlines()) == 300
        assert len((root / "logs" / "retried.jsonl").read_text().splitlines()) == 300


def test_an_idle_watch_stops_promptly_on_sigterm_and_says_so(tmp_path: Path) -> None:
    config = make_queue(tmp_path, model="celeris-tiny", rescan_s=5.0)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(
        [sys.executable, "-m", "celeris_cli", "watch", str(config)], env=env, stderr=subprocess.PIPE, text=True
    )
    heartbeat = tmp_path / "logs" / "heartbeat.json"
    wait_for(lambda: heartbeat.exists() and json.loads(heartbeat.read_text())["state"] == "idle", timeout=120)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 0 and "celeris watch: stopped on SIGTERM (0 files, 0 results, 0 failures" in err, err
    assert took < 1.0, took  # the interpreter's teardown of torch alone took ~2 s here


def test_a_death_between_the_late_watch_and_the_move_loses_and_repeats_no_line(tmp_path: Path) -> None:
    from celeris_cli.spool.fsutil import CRASH_EXIT

    config = make_queue(tmp_path)
    drop(tmp_path, "w.txt", "one\ntwo\n")
    assert run(config, "--once", crash="after_late_watch").returncode == CRASH_EXIT
    [name] = claimed(tmp_path)
    with open(tmp_path / "batch_inputs" / ".work" / name, "a") as f:
        f.write("three\n")  # while the daemon is dead: still claimed, so served
    os.utime(tmp_path / "batch_inputs" / ".work" / name, (time.time() - 10, time.time() - 10))
    assert run(config, "--once").returncode == 0
    assert [r["custom_id"] for r in outputs(tmp_path)["w.txt.results.jsonl"]] == ["line-1", "line-2", "line-3"]
    assert failures(tmp_path) == []
    with open(tmp_path / "batch_processed" / "w.txt", "a") as f:
        f.write("four\n")  # after the publish: recorded, once
    assert run(config, "--once").returncode == 1
    assert run(config, "--once").returncode == 0
    [rec] = failures(tmp_path)
    assert rec["code"] == "changed_after_claim" and rec["source"]["line"] == 4 and rec["request"]["prompt"] == "four"
