"""Finishing a claimed file whose requests are all decided: serve lines appended to it meanwhile, wait
while a writer may still hold it, then publish; a publish the filesystem refuses (full disk, read-only or
unwritable folder, a folder deleted under it) is retried later with back-off and never recorded as the
requests' failure.

The `Finisher` gets what it uses (settings, publisher, events, metrics, the late-lines watch and a
function that prepares appended requests) and answers what it published; the daemon keeps its own state.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .batching import Item
from .config import BatchConfig
from .formats import FileRejected, Request
from .fsutil import crashpoint, fsync_dir, sync_folder
from .intake import Job
from .late import CODE as CHANGED
from .late import LateLines
from .ledger import EventLog, failure_of_changed_line, failure_of_file
from .metrics import Metrics
from .publish import Publisher, line_failure
from .reading import read_claimed

log = logging.getLogger(__name__)

# errors that block a publish for now: a full disk, no permission, a read-only or a vanished folder
BLOCKING_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT}
ONCE_PUBLISH_TRIES = 3  # --once gives up on a blocked publish after this many tries
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class Published:
    job: Job
    results: int
    failures: int


@dataclass(frozen=True)
class Deferral:
    """A publish put off: until `not_before`, after `blocked` refusals by the filesystem in a row."""

    not_before: float
    blocked: int = 0


@dataclass
class Completion:
    work: list[Item] = field(default_factory=list)  # appended requests to decode
    published: list[Published] = field(default_factory=list)


class Finisher:
    def __init__(
        self,
        cfg: BatchConfig,
        publisher: Publisher,
        late: LateLines,
        events: EventLog,
        metrics: Metrics,
        prepare: Callable[[Job, list[Request]], list[Item]],
        ensure_folders: Callable[[], object],
    ) -> None:
        self.cfg = cfg
        self.f = cfg.folders
        self.pub = publisher
        self.late = late
        self.events = events
        self.metrics = metrics
        self.prepare = prepare
        self.ensure_folders = ensure_folders
        self.deferred: dict[int, Deferral] = {}  # claim -> a publish put off (a young file, a full disk)

    def due(self, jobs: list[Job], now: float) -> list[Job]:
        """Jobs whose deferred publish may be tried again now."""
        return [j for j in jobs if j.seq in self.deferred and self.deferred[j.seq].not_before <= now]

    def next_due(self, jobs: list[Job]) -> float:
        """When the first of `jobs` may go on: 0 for one not deferred (it is in progress)."""
        return min((self.deferred[j.seq].not_before if j.seq in self.deferred else 0.0) for j in jobs)

    def gave_up(self, jobs: list[Job], tries: int) -> bool:
        """Every job's publish was refused by the filesystem `tries` times in a row (`--once` stops)."""
        return all(j.seq in self.deferred and self.deferred[j.seq].blocked >= tries for j in jobs)

    def complete(self, jobs: list[Job]) -> Completion:
        """Jobs with every request decided: new work for files that grew; the others published as one
        group (one folder fsync for all of them), or their publish deferred."""
        done = Completion()
        ready: list[Job] = []
        now = time.time()
        for job in jobs:
            try:
                got = read_claimed(job.path, job.name, job.snapshot, self.cfg.settle_s, self.cfg.max_line_bytes, now)
            except (OSError, FileRejected):
                ready.append(job)  # removed or replaced by hand while claimed: publish what was decided
                continue
            job.snapshot = got.snapshot
            job.failures += [line_failure(job, e) for e in got.errors]
            if got.rewritten:
                message = f"the file was rewritten after it was claimed (now {got.snapshot.whole} bytes)"
                job.failures.append(failure_of_file(job.name, job.seq, CHANGED, message))
            job.failures += [failure_of_changed_line(job.name, job.seq, line, CHANGED) for line in got.changed]
            if got.requests:
                job.requests += got.requests
                self.events("grown", file=job.name, claim=job.seq, new_requests=len(got.requests))
                new = self.prepare(job, got.requests)
                if new:
                    done.work += new
                    continue
            if now - got.mtime < self.cfg.settle_s:  # a writer may still hold it open
                blocked = self.deferred[job.seq].blocked if job.seq in self.deferred else 0
                self.deferred[job.seq] = Deferral(got.mtime + self.cfg.settle_s, blocked)
                continue
            ready.append(job)
        if ready:
            done.published = self.publish(ready)
        return done

    def publish(self, jobs: list[Job]) -> list[Published]:
        """Results, then failure records, then inputs to processed/: each step durable, for the whole
        group, before the next."""
        self.ensure_folders()
        staged: dict[int, list[tuple[Path, Path]]] = {}
        for job in jobs:
            try:
                staged[job.seq] = self.pub.stage(job)
            except OSError as e:
                self.blocked_or_raise(job, e)
        written = [job for job in jobs if job.seq in staged]
        if not written:
            return []
        temps = [tmp for pairs in staged.values() for tmp, _ in pairs]
        try:
            sync_folder(self.f.outputs, temps)
        except OSError as e:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            for job in written:
                self.blocked_or_raise(job, e)
            return []
        crashpoint("after_output_tmp")
        try:
            for pairs in staged.values():
                for tmp, final in pairs:
                    os.replace(tmp, final)
            fsync_dir(self.f.outputs)
        except OSError as e:  # the folder deleted under us: results are deterministic, redone later
            for job in written:
                self.blocked_or_raise(job, e)
            return []
        crashpoint("after_publish")
        counts = {}
        for job in list(written):
            try:
                counts[job.seq] = self.pub.records(job)
            except OSError as e:
                self.blocked_or_raise(job, e)
                written.remove(job)
        present = [job for job in written if job.path.exists()]
        places = {j.seq: [self.f.processed / j.name, self.f.processed / f"{j.name}~{j.seq}"] for j in present}
        try:  # a writer may not be done with them: watch them, before they move, for late lines
            self.late.watch([(j.name, j.seq, j.path, places[j.seq], j.snapshot) for j in present])
        except OSError as e:
            for job in written:
                self.blocked_or_raise(job, e)
            return []
        crashpoint("after_late_watch")
        for job in present:
            try:
                self.pub.processed(job)
            except OSError as e:  # processed/ deleted under us: published again (the same) and moved later
                self.blocked_or_raise(job, e)
                written.remove(job)
        try:
            fsync_dir(self.f.processed)
            fsync_dir(self.f.work)
        except FileNotFoundError:
            pass  # deleted under us, with what it held: nothing of ours left to make durable there
        crashpoint("after_move")
        out = []
        for job in written:
            self.deferred.pop(job.seq, None)
            job.journal.remove()
            failed, recorded = counts[job.seq]
            results = sum(1 for o in job.outcomes.values() if "body" in o)
            codes = [r["code"] for r in job.failures] + [
                o["failure"]["code"] for o in job.outcomes.values() if "failure" in o
            ]
            self.metrics.published(results, codes)
            self.events(
                "published",
                file=job.name,
                claim=job.seq,
                results=results,
                failures=failed,
                new_failure_records=recorded,
            )
            out.append(Published(job, results, failed))
        return out

    def forget(self, job: Job) -> None:
        """`job` is no longer claimed (quarantined, or removed by hand): drop its deferral."""
        self.deferred.pop(job.seq, None)

    def blocked_or_raise(self, job: Job, e: OSError) -> None:
        """Put off a step the filesystem refuses for now (a publish, a quarantine), with back-off; raise
        any other error."""
        if e.errno not in BLOCKING_ERRNOS:
            raise e
        for suffix in (".results.jsonl", ".results.txt"):  # no half-written temp file stays behind
            (self.f.outputs / f".{job.name}{suffix}.tmp").unlink(missing_ok=True)
        blocked = (self.deferred[job.seq].blocked if job.seq in self.deferred else 0) + 1
        delay = min(MAX_BACKOFF_S, self.cfg.publish_retry_s * 2 ** (blocked - 1))
        self.deferred[job.seq] = Deferral(time.time() + delay, blocked)
        if blocked == 1:  # once: a restart publishes without decoding (retries add nothing to the journal)
            job.journal.append({"outcomes": list(job.outcomes.values())})
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        log.warning("cannot publish %s: %s (%s); retrying in %.1f s", job.name, e.strerror, code, delay)
        self.events("publish_blocked", file=job.name, claim=job.seq, errno=code, message=str(e), retry_in_s=delay)
