"""The journal of one `celeris batch` run: what is finished, kept across crashes, so a rerun resumes.

`OUTPUT.celeris-journal` beside the output, appended and fsynced once per finished batch (the queue's
`append_line`: a torn tail left by a crash is cut off before the next append). One JSON object a line:
- first, the key: `{"celeris_batch_journal": 1, "input": {...}, "settings": {...}}`: the input's path,
  size, mtime, a hash of its bytes and one short hash per line, and the settings that decide the answers;
- then per finished batch: `{"done": [lines], "results": [result lines], "failures": [records]}`, the
  result lines in the final shape of `OUTPUT`, so `jq -c '.results[]?' OUTPUT.celeris-journal` shows the
  answers finished so far while the run goes on.

A rerun with the same key skips every journaled line; a different input or different settings is refused
with a message naming the change (`--restart` starts over). The journal is removed once OUTPUT is whole.
"""

from __future__ import annotations

import glob
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..spool.fsutil import append_line, crashpoint, fsync_dir
from ..spool.ledger import dumps, read_jsonl

log = logging.getLogger(__name__)

VERSION = 1
SUFFIX = ".celeris-journal"


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + SUFFIX)


def input_identity(path: Path, data: bytes) -> dict[str, Any]:
    """What a journal must match to be resumed: path, size, mtime, the bytes' hash, and a hash per line
    (so a refusal can name the line that changed)."""
    st = path.stat()
    lines = [hashlib.sha256(x).hexdigest()[:12] for x in data.splitlines()]
    return {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": hashlib.sha256(data).hexdigest(),
        "lines": lines,
    }


@dataclass
class Finished:
    """What earlier runs finished: result lines and failure records by input line."""

    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def lines(self) -> set[int]:
        return set(self.results) | set(self.failures)


class BatchJournal:
    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, identity: dict[str, Any], settings: dict[str, Any], restart: bool = False) -> Finished:
        """Start a journal, or resume the one there when its key matches; a mismatch is a UsageError
        naming the change, unless `restart`."""
        if restart:
            self.remove()
        records = list(read_jsonl(self.path))
        if records and records[0].get("celeris_batch_journal") == VERSION:
            _check_key(self.path, records[0], identity, settings)
            finished = Finished()
            for rec in records[1:]:
                for res in rec.get("results", []):
                    finished.results[int(res["id"].rsplit(":", 1)[1])] = res
                for fail in rec.get("failures", []):
                    finished.failures[int(fail["source"]["line"])] = fail
            log.info("resuming from %s: %d requests already finished", self.path, len(finished.lines))
            return finished
        if records:  # not a journal this version can read: not ours to delete silently
            raise UsageError(f"{self.path} is not a journal of this version of celeris; rerun with --restart")
        self.path.unlink(missing_ok=True)  # absent, or only a key torn by a crash: nothing was finished
        append_line(self.path, dumps({"celeris_batch_journal": VERSION, "input": identity, "settings": settings}))
        fsync_dir(self.path.parent)
        return Finished()

    def append(self, results: list[dict[str, Any]], failures: list[dict[str, Any]], done: list[int]) -> None:
        """One finished batch, durably (fsynced) before the next one is decoded."""
        append_line(self.path, dumps({"done": done, "results": results, "failures": failures}))
        crashpoint("batch-journaled")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.path.parent.is_dir():
            fsync_dir(self.path.parent)


def remove_stale_temps(paths: list[Path]) -> None:
    """Temp files of `atomic_write` (`.NAME.PID.tmp`) that a killed run left beside its outputs."""
    for path in paths:
        for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            if tmp.name[len(path.name) + 2 : -4].isdigit():
                log.info("removing %s, left by an interrupted run", tmp)
                tmp.unlink(missing_ok=True)


def _check_key(path: Path, head: dict[str, Any], identity: dict[str, Any], settings: dict[str, Any]) -> None:
    was, now = head.get("input", {}), identity
    hint = f"; rerun with --restart to start over (the journal is {path})"
    if was.get("path") != now["path"]:
        raise UsageError(f"the interrupted run read {was.get('path')}, this one reads {now['path']}{hint}")
    if was.get("sha256") != now["sha256"]:
        raise UsageError(f"{now['path']} changed since the interrupted run: {_line_change(was, now)}{hint}")
    if was.get("mtime_ns") != now["mtime_ns"]:  # touched, same bytes: the answers cannot differ
        log.warning("%s was touched since the interrupted run, its content is the same; resuming", now["path"])
    old = head.get("settings", {})
    changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if changed:
        diffs = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in changed)
        raise UsageError(f"the settings changed since the interrupted run ({diffs}){hint}")


def _line_change(was: dict[str, Any], now: dict[str, Any]) -> str:
    a, b = was.get("lines", []), now["lines"]
    diff = [i + 1 for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]
    if not diff:
        return f"size {was.get('size')} -> {now['size']} bytes"
    more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
    if len(a) != len(b):
        return f"{len(a)} lines -> {len(b)}, first difference at line {diff[0]}{more}"
    return f"line {diff[0]} differs{more}"
