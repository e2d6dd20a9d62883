"""Reading a claimed file: the one function the daemon (first read) and the finisher (re-reads before a
publish, and checks of a published file) share, so they agree on which lines were read.

A file is read in whole lines while its writer may still be at work (its mtime younger than
`settle_s`): a last line without its newline waits. A settled file's last line is read without its
newline. What was read is a `Snapshot`; a later read compares the file with it:
- lines after the snapshot are new: the caller serves them, or records them when it is too late;
- a last line read without its newline that has since grown is `changed` (its number is reported);
- a file whose bytes before the snapshot's end differ was `rewritten`: nothing more is read from it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from .formats import FileRejected, LineError, Request, parse_file


@dataclass(frozen=True)
class Snapshot:
    """What has been read of a file: `whole` bytes of whole lines (`lines` of them, `digest` of them),
    then `tail`, a last line read without its newline (only in a settled file)."""

    whole: int = 0
    digest: str = hashlib.sha256(b"").hexdigest()
    lines: int = 0
    tail: bytes = b""

    @property
    def last_line(self) -> int:
        return self.lines + (1 if self.tail else 0)


@dataclass(frozen=True)
class Read:
    snapshot: Snapshot
    mtime: float
    requests: list[Request] = field(default_factory=list)  # lines after the earlier snapshot
    errors: list[LineError] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)  # line numbers read before that differ now
    rewritten: bool = False


def read_claimed(
    path: Path, name: str, before: Snapshot, settle_s: float, max_line_bytes: int, now: float | None = None
) -> Read:
    """Read `path` (parsed as `name`) past `before`. Raises FileRejected for what is not a regular file
    or cannot be parsed at all, OSError when it cannot be read."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise FileRejected("symlink", "symlinks in the inbox are not followed; publish a regular file")
    if not stat.S_ISREG(st.st_mode):
        raise FileRejected("not_a_file", "only regular files are read")
    with open(path, "rb") as f:
        data = f.read(st.st_size)  # only what the stat saw: bytes appended since are not known settled
    settled = (time.time() if now is None else now) - st.st_mtime >= settle_s
    if not settled:
        data = data[: data.rfind(b"\n") + 1]  # a writer may be mid-line: read its whole lines only, if any
    if len(data) < before.whole or hashlib.sha256(data[: before.whole]).hexdigest() != before.digest:
        return Read(_snapshot(data), st.st_mtime, rewritten=True)
    fresh = before == Snapshot()
    if fresh and not data and not settled:
        return Read(before, st.st_mtime)  # not one whole line yet
    if not fresh and not before.tail and len(data) == before.whole:
        return Read(before, st.st_mtime)
    changed = []
    if before.tail:
        end = data.find(b"\n", before.whole)
        if (data[before.whole : end] if end >= 0 else data[before.whole :]) != before.tail:
            changed.append(before.last_line)
    now_snap = _snapshot(data)
    if now_snap == before and not fresh:
        return Read(before, st.st_mtime)
    requests, errors = parse_file(name, data, max_line_bytes)
    first = before.last_line
    return Read(
        now_snap,
        st.st_mtime,
        [r for r in requests if r.line > first],
        [e for e in errors if e.line > first],
        changed,
    )


def _snapshot(data: bytes) -> Snapshot:
    whole = data.rfind(b"\n") + 1
    return Snapshot(whole, hashlib.sha256(data[:whole]).hexdigest(), data.count(b"\n"), data[whole:])
