"""Intake: which inbox files are ready, and claiming one by renaming it into the work folder.

Settle rule: a file is ready once its mtime is `settle_s` old, or when two scans saw the same size and it
ends with a newline (a producer that published by rename). Dot-files, `*.tmp` and `*.part` are never read.

Each arrival gets a claim number from a durable counter. The claimed file is `.work/<claim>.<name>`, so
it keeps its identity across stops and crashes: at startup it is resumed where it is, never renamed back
over a newer file of the same name. `<name>` is the inbox name, or a derived name (`names`) when that
name is too long, or already has results, a processed or quarantined copy, or a claim in progress.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import names
from .config import Folders
from .formats import Request
from .fsutil import atomic_write, crashpoint, rename_noreplace
from .journal import Journal
from .ledger import EventLog
from .reading import Snapshot

IGNORED_SUFFIXES = (".tmp", ".part")
WORK_NAME = re.compile(r"^(\d{8,})\.(.+)$", re.DOTALL)  # a name may hold a newline
REFUSED_S = 30.0  # a file whose claim failed is tried again after this long
SEQ_BLOCK = 64  # claim numbers reserved per counter write (one fsync per block, not per claim)


def is_candidate(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(IGNORED_SUFFIXES)


@dataclass
class Job:
    """One claimed input file and what has become of its requests."""

    seq: int
    name: str  # the name its results, processed copy and failure records use
    path: Path
    journal: Journal
    requests: list[Request] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  # lines that never became requests
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)  # line -> {"body"} | {"failure"}
    pending: int = 0
    resumed: bool = False
    suspects: set[int] | None = field(default_factory=set)  # lines to test in groups (None: all remaining)
    groups: list[set[int]] = field(default_factory=list)  # the suspects' groups, in order (`journal`)
    snapshot: Snapshot = Snapshot()  # what has been read of the file (reading.read_claimed)


class Inbox:
    """The inbox and its work folder: scan, number and claim arrivals, and find earlier claims."""

    def __init__(self, folders: Folders, settle_s: float, events: EventLog) -> None:
        self.f = folders
        self.settle_s = settle_s
        self.events = events
        self.seen_sizes: dict[str, tuple[int, float]] = {}
        self.depth = 0  # inbox files at the last scan, ready or settling
        self.oldest_mtime: float | None = None
        self.active: set[str] = set()  # names of claims in progress
        self.refused: dict[str, float] = {}  # name -> when to try a claim that failed again
        self.seq_file = folders.work / ".seq"
        self.next_seq = 1
        self.reserved = 0

    def open(self, min_seq: int) -> list[Job]:
        """Start the counter past every claim ever made, and return earlier claims to resume, oldest first.
        Entries of an older layout (no claim number) are numbered where they are, without a rename back."""
        try:
            stored = int(self.seq_file.read_text().strip() or 0)
        except (OSError, ValueError):
            stored = 0
        jobs: list[Job] = []
        legacy: list[Path] = []
        for entry in sorted(self.f.work.iterdir()):
            if entry.name.startswith(".") or entry.is_dir():
                continue
            m = WORK_NAME.match(entry.name)
            if m:
                jobs.append(self._job(int(m.group(1)), m.group(2)))
            else:
                legacy.append(entry)
        self.next_seq = max([stored, min_seq, *(j.seq for j in jobs)]) + 1
        self.reserved = self.next_seq - 1
        for entry in legacy:
            seq = self.take_seq()
            name = names.fit(entry.name)
            if rename_noreplace(entry, self.f.work / f"{seq:08d}.{name}"):
                jobs.append(self._job(seq, name))
        known = {f"{j.seq:08d}.jsonl" for j in jobs}
        journals = self.f.work / "journal"
        for orphan in journals.glob("*.jsonl") if journals.is_dir() else []:
            if orphan.name not in known:  # its file was published; only the cleanup was cut short
                orphan.unlink(missing_ok=True)
        resumed = []
        for job in sorted(jobs, key=lambda j: j.seq):
            if job.name in self.active:  # two claims of one name (an older version's ~N rename): never
                moved = self._job(job.seq, self.job_name(job.name, job.seq))  # publish both under it
                if rename_noreplace(job.path, moved.path):
                    self.events("renamed", file=moved.name, claim=job.seq, original=job.name)
                    job = moved
            job.resumed = True
            self.active.add(job.name)
            self.events("resumed", file=job.name, claim=job.seq)
            resumed.append(job)
        return resumed

    def take_seq(self) -> int:
        seq = self.next_seq
        if seq > self.reserved:
            self.reserved = seq + SEQ_BLOCK - 1
            atomic_write(self.seq_file, f"{self.reserved}\n".encode())
        self.next_seq += 1
        return seq

    def _job(self, seq: int, name: str) -> Job:
        return Job(seq, name, self.f.work / f"{seq:08d}.{name}", Journal(self.f.work / "journal" / f"{seq:08d}.jsonl"))

    def scan(self) -> tuple[list[Path], int]:
        """Inbox entries ready to claim (oldest first), and how many are still settling."""
        now = time.time()
        ready: list[tuple[float, str, Path]] = []
        waiting = 0
        sizes: dict[str, tuple[int, float]] = {}
        try:
            entries = list(os.scandir(self.f.inputs))
        except FileNotFoundError:  # deleted under us: the daemon creates it again
            entries = []
        present = {e.name for e in entries}
        self.refused = {n: t for n, t in self.refused.items() if t > now and n in present}
        for entry in entries:
            if not is_candidate(entry.name) or self.refused.get(entry.name, 0) > now:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                continue
            path = Path(entry.path)
            sizes[entry.name] = (st.st_size, st.st_mtime)
            settled = now - st.st_mtime >= self.settle_s
            if not stat.S_ISREG(st.st_mode) or settled or self._stable(entry.name, sizes[entry.name], path):
                ready.append((st.st_mtime, entry.name, path))
            else:
                waiting += 1
        self.seen_sizes = sizes
        self.depth = len(sizes)
        self.oldest_mtime = min((m for _, m in sizes.values()), default=None)
        ready.sort()
        return [p for _, _, p in ready], waiting

    def _stable(self, name: str, size: tuple[int, float], path: Path) -> bool:
        """Unchanged since the last scan and ending in a newline: published whole, though its mtime is fresh."""
        return self.seen_sizes.get(name) == size and _ends_with_newline(path)

    def taken(self, name: str) -> bool:
        """A name in use: claimed now, or with results, a processed or a quarantined copy."""
        return (
            name in self.active
            or os.path.lexists(self.f.outputs / f"{name}.results.jsonl")
            or os.path.lexists(self.f.processed / name)
            or os.path.lexists(self.f.quarantine / name)
        )

    def job_name(self, inbox_name: str, seq: int) -> str:
        """The name a claim publishes under: the inbox name where it is free and fits; otherwise a derived
        name (shortened, or `~claim`) that is free and that no file in the inbox has either, so a
        derived name can never take a name a user wrote."""
        name = names.fit(inbox_name)
        if name == inbox_name and not self.taken(name):
            return name
        for attempt in range(1000):
            candidate = names.renamed(name, seq, attempt) if (attempt or self.taken(name)) else name
            if not self.taken(candidate) and not os.path.lexists(self.f.inputs / candidate):
                return candidate
        raise FileExistsError(f"no free name for {inbox_name!r}")  # 1000 files named so: not a user's doing

    def claim(self, path: Path) -> Job | None:
        seq = self.take_seq()
        name = self.job_name(path.name, seq)
        job = self._job(seq, name)
        try:
            os.rename(path, job.path)  # the work name is new (a fresh claim number): nothing to overwrite
        except FileNotFoundError:
            return None  # taken or removed meanwhile
        crashpoint("after_claim")
        self.active.add(name)
        self.events("claim", file=name, claim=seq, original=path.name if name != path.name else None)
        return job

    def refuse(self, name: str) -> None:
        """A claim of `name` failed: leave it alone for a while instead of failing again every round."""
        self.refused[name] = time.time() + REFUSED_S

    def release(self, job: Job) -> None:
        self.active.discard(job.name)


def _ends_with_newline(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return False
