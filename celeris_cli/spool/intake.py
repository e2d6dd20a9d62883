"""Intake: which inbox files are ready, and claiming one by renaming it into the work folder.

A file is ready once its mtime is `settle_s` old, or when two scans saw the same size and it ends with
a newline (a producer that published by rename). Dot-files, `*.tmp` and `*.part` are never read.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Folders
from .formats import Request
from .fsutil import crashpoint, move
from .ledger import EventLog

IGNORED_SUFFIXES = (".tmp", ".part")


def is_candidate(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(IGNORED_SUFFIXES)


@dataclass
class Job:
    """One claimed input file and what has become of its requests."""

    name: str
    path: Path
    requests: list[Request] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: int = 0


class Inbox:
    """The inbox and its work folder: scan, claim, and give claimed files back."""

    def __init__(self, folders: Folders, settle_s: float, events: EventLog) -> None:
        self.f = folders
        self.settle_s = settle_s
        self.events = events
        self.seen_sizes: dict[str, tuple[int, float]] = {}

    def scan(self) -> tuple[list[Path], int]:
        """Inbox entries ready to claim (oldest first), and how many are still settling."""
        now = time.time()
        ready: list[tuple[float, str, Path]] = []
        waiting = 0
        sizes: dict[str, tuple[int, float]] = {}
        for entry in os.scandir(self.f.inputs):
            if not is_candidate(entry.name):
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
            stable = self.seen_sizes.get(entry.name) == sizes[entry.name] and _ends_with_newline(path)
            if not stat.S_ISREG(st.st_mode) or settled or stable:
                ready.append((st.st_mtime, entry.name, path))
            else:
                waiting += 1
        self.seen_sizes = sizes
        ready.sort()
        return [p for _, _, p in ready], waiting

    def claim(self, path: Path) -> Job | None:
        name = path.name
        # a name already processed earlier gets a fresh one, so earlier results are never overwritten
        if (self.f.processed / name).exists() or (self.f.quarantine / name).exists():
            stem, dot, suffix = name.rpartition(".") if "." in name else (name, "", "")
            n = 2
            while True:
                name = f"{stem}~{n}{dot}{suffix}" if dot else f"{stem}~{n}"
                if not any((d / name).exists() for d in (self.f.processed, self.f.quarantine, self.f.inputs)):
                    break
                n += 1
        try:
            os.rename(path, self.f.work / name)
        except FileNotFoundError:
            return None  # taken or removed meanwhile
        crashpoint("after_claim")
        self.events("claim", file=name, original=path.name if name != path.name else None)
        return Job(name, self.f.work / name)

    def recover(self) -> None:
        """At startup, whatever a stopped daemon left in the work folder goes back to the inbox."""
        for entry in sorted(self.f.work.iterdir()):
            move(entry, self.f.inputs / entry.name)
            self.events("recovered", file=entry.name)

    def requeue(self, jobs: list[Job]) -> None:
        """Give claimed but unfinished files back to the inbox."""
        for job in jobs:
            if job.path.exists():
                move(job.path, self.f.inputs / job.name)
                self.events("requeued", file=job.name)


def _ends_with_newline(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return False
