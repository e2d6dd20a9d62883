"""Lines that reach a file after it was published: a writer that paused longer than `settle_s` and
then went on appending through its open handle (the file is in `processed/` by then).

Nothing can tell such a pause from a finished file, so the queue keeps watching each published file
for `late_window_s`. Each line that arrives gets a failure record, never silence: a request gets a
retryable `changed_after_claim` record with its line number and the request itself (`celeris retry`
serves it), a bad line its own code, and a line that changed after it was read a `changed_after_claim`
record naming it. The files watched are kept in `processed/.late.json` (beside them), so `watch --once` runs from
cron watch them too. A file is put on the watch (durably) before it is moved to `processed/`, so a death
between the two cannot lose it; it is known there by its inode, and checked only once it is there (while
it is still claimed, a restart reads it whole and serves every line).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .formats import FileRejected
from .fsutil import atomic_write
from .ledger import (
    EventLog,
    FailureLog,
    failure_of_changed_line,
    failure_of_file,
    failure_of_line,
    failure_of_request,
)
from .reading import Snapshot, read_claimed

log = logging.getLogger(__name__)

CODE = "changed_after_claim"


@dataclass(frozen=True)
class Watched:
    name: str  # the name its results and records use
    claim: int
    paths: list[str]  # where its processed copy may be
    inode: int
    snapshot: Snapshot
    until: float

    def find(self) -> Path | None:
        """Its processed copy (the candidate with its inode), or None while it is not there."""
        for p in self.paths:
            try:
                if Path(p).stat().st_ino == self.inode:
                    return Path(p)
            except OSError:
                continue
        return None


class LateLines:
    """The watch. `check` looks at the files at most once per `check_every_s` (the daemon's rescan pace),
    however often the daemon's loop comes round: it stats every file published in the last `window_s`."""

    def __init__(
        self,
        state: Path,
        failures: FailureLog,
        events: EventLog,
        settle_s: float,
        max_line_bytes: int,
        window_s: float,
        check_every_s: float = 0.0,
    ) -> None:
        self.state = state
        self.failures = failures
        self.events = events
        self.settle_s = settle_s
        self.max_line_bytes = max_line_bytes
        self.window_s = window_s
        self.check_every_s = check_every_s
        self.next_check = 0.0
        self.watched: list[Watched] = _load(state)
        self.encoded: dict[tuple[int, str], tuple[Watched, str]] = {}  # each entry's JSON, kept for the next save

    def watch(self, files: list[tuple[str, int, Path, list[Path], Snapshot]]) -> None:
        """Watch files (name, claim, claimed path, places it is about to move to, snapshot), with one
        durable write for the group. Raises OSError when the watch cannot be saved (a full disk): the
        caller does not move the files then."""
        if self.window_s <= 0 or not files:
            return
        until = time.time() + self.window_s
        new = [
            Watched(n, c, [str(p) for p in places], path.stat().st_ino, snap, until)
            for n, c, path, places, snap in files
        ]
        old = {(w.claim, w.name): w for w in self.watched}
        if all(_same_watch(old.get((w.claim, w.name)), w) for w in new):
            return  # a publish redone (after a refusal) watches what is watched already: nothing to write
        keys = {(w.claim, w.name) for w in new}
        self.watched = [x for x in self.watched if (x.claim, x.name) not in keys] + new
        atomic_write(self.state, self._dump())

    def check(self, now: float | None = None) -> int:
        """Record the lines that reached a watched file since the last check, at most once per
        `check_every_s`. Returns the records written."""
        now = time.time() if now is None else now
        if now < self.next_check:
            return 0
        self.next_check = now + self.check_every_s
        kept: list[Watched] = []
        recorded = 0
        for w in self.watched:
            try:
                path = w.find()
                if path is None or path.stat().st_size == w.snapshot.whole + len(w.snapshot.tail):
                    got = None
                else:
                    got = read_claimed(path, w.name, w.snapshot, self.settle_s, self.max_line_bytes, now)
            except (OSError, FileRejected):
                continue  # moved or removed by its owner: no longer ours to watch
            if got is not None:
                try:
                    recorded += self._record(w, got.requests, got.errors, got.changed, got.rewritten)
                except OSError as e:  # a full disk, logs/ deleted: keep the old snapshot, record them next round
                    log.warning("cannot record the late lines of %s: %s; trying again", w.name, e)
                    kept.append(w)
                    continue
                w = replace(w, snapshot=got.snapshot)
            if w.until > now:
                kept.append(w)
        if kept != self.watched:
            self.watched = kept
            self._save()
        return recorded

    def _record(self, w: Watched, requests: list[Any], errors: list[Any], changed: list[int], rewritten: bool) -> int:
        recs = [
            failure_of_request(
                w.name, w.claim, r, CODE, f"line {r.line} arrived after the file was published; retry serves it", True
            )
            for r in requests
        ]
        recs += [failure_of_line(w.name, w.claim, e) for e in errors]
        recs += [failure_of_changed_line(w.name, w.claim, line, CODE) for line in changed]
        if rewritten:
            recs.append(failure_of_file(w.name, w.claim, CODE, "the file was rewritten after it was published"))
        written = sum(self.failures.append(rec) for rec in recs)
        if recs:
            lines = sorted({r["source"]["line"] for r in recs})
            log.warning("%s: %d line(s) arrived or changed after it was published: %s", w.name, len(recs), lines)
            self.events("late_lines", file=w.name, claim=w.claim, lines=lines)
        return written

    def _dump(self) -> bytes:
        """The state file: each entry encoded once, not again at every save (it is saved at every publish)."""
        encoded = {}
        for w in self.watched:
            key = (w.claim, w.name)
            hit = self.encoded.get(key)
            encoded[key] = hit if hit is not None and hit[0] is w else (w, json.dumps(_as_json(w)))
        self.encoded = encoded
        return ("[" + ", ".join(text for _, text in encoded.values()) + "]").encode()

    def _save(self) -> None:
        try:
            atomic_write(self.state, self._dump())
        except OSError as e:  # a full disk: the watch goes on in this process
            log.warning("cannot write %s: %s", self.state, e)


def _as_json(w: Watched) -> dict[str, Any]:
    snap = w.snapshot
    snapshot = {"whole": snap.whole, "digest": snap.digest, "lines": snap.lines, "tail": snap.tail.hex()}
    return {
        "name": w.name,
        "claim": w.claim,
        "paths": w.paths,
        "inode": w.inode,
        "snapshot": snapshot,
        "until": w.until,
    }


def _same_watch(old: Watched | None, new: Watched) -> bool:
    """The same file watched from the same snapshot (its watch may end a little later)."""
    return old is not None and (old.paths, old.inode, old.snapshot) == (new.paths, new.inode, new.snapshot)


def _load(state: Path) -> list[Watched]:
    try:
        out = []
        for w in json.loads(state.read_text()):
            snap = Snapshot(**{**w["snapshot"], "tail": bytes.fromhex(w["snapshot"]["tail"])})
            out.append(Watched(w["name"], w["claim"], w["paths"], w["inode"], snap, w["until"]))
        return out
    except (OSError, ValueError, KeyError, TypeError):
        return []
