"""The late-lines watch (spool/late.py) on its own: how often it looks at the files it watches, and when
it writes its state file."""

from __future__ import annotations

import json
import time
from pathlib import Path

from celeris_cli.spool.late import LateLines
from celeris_cli.spool.ledger import EventLog, FailureLog
from celeris_cli.spool.reading import Snapshot, read_claimed


def watching(tmp_path: Path, every_s: float) -> tuple[LateLines, Path, Snapshot]:
    """A watch over one published file, `done/f.jsonl`, whose one line was read."""
    (tmp_path / "done").mkdir()
    path = tmp_path / "done" / "f.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "p"}) + "\n")
    snap = read_claimed(path, "f.jsonl", Snapshot(), settle_s=0, max_line_bytes=1000).snapshot
    log = FailureLog(tmp_path / "failed.jsonl")
    late = LateLines(tmp_path / "done" / ".late.json", log, EventLog(tmp_path / "events.jsonl"), 0, 1000, 600, every_s)
    late.watch([("f.jsonl", 1, path, [path], snap)])
    return late, path, snap


def append(path: Path, custom_id: str) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"id": custom_id, "prompt": "p"}) + "\n")


def test_the_watched_files_are_looked_at_once_per_interval_not_every_round(tmp_path: Path) -> None:
    late, path, _ = watching(tmp_path, every_s=60)
    now = time.time()
    append(path, "b")
    assert late.check(now) == 1
    append(path, "c")
    assert late.check(now + 1) == 0  # the daemon's next round: not yet
    assert late.check(now + 61) == 1


def test_watching_a_file_again_unchanged_does_not_rewrite_the_state_file(tmp_path: Path) -> None:
    late, path, snap = watching(tmp_path, every_s=60)
    state = tmp_path / "done" / ".late.json"
    before = state.stat().st_ino
    late.watch([("f.jsonl", 1, path, [path], snap)])  # a publish redone after a refusal: the same watch
    assert state.stat().st_ino == before
    reloaded = LateLines(state, late.failures, late.events, 0, 1000, 600, 60)
    assert [(w.name, w.claim, w.snapshot) for w in reloaded.watched] == [("f.jsonl", 1, snap)]
