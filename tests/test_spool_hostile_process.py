"""Hostile faults with real subprocesses: a name with a newline across SIGTERM and restart, concurrent
`celeris retry`, folders deleted under a running daemon, a prompt SIGTERM of an idle daemon."""

from __future__ import annotations

import signal
from pathlib import Path

from .spool_helpers import claimed, drop, failures, make_queue, outputs, visible
from .test_spool_process import run, spawn, wait_for


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
