"""The spool daemon: inbox -> claim -> batch -> publish -> processed, with no lost work.

State lives in the folders (Maildir, Postfix qmgr): a claimed file stays in `inputs/.work/` under its
claim number, with a journal of its finished batches, until its results are published; at startup it is
resumed there, and only its undecided requests are decoded. Watchdog events only wake the loop; the loop
also rescans every `rescan_s`. This module runs the loop; intake (claims), journal and poison (resuming),
batching (bisecting, timeouts), finish and publish (commit order, full disks) and signals have their own.

Batches run on a pool (`pool`): the in-process engine keeps one in flight, a Ray actor pool one per actor.
Each batch is journaled, and its finished files published, as it completes, in whatever order; claiming,
journals, publishing and the lock stay here, in this one process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EXIT_FAILED, EXIT_IO, EXIT_OK, CelerisError
from . import poison, signals
from .backend import Backend
from .batching import Decided, Item, describe, pack, settle
from .config import BatchConfig
from .finish import ONCE_PUBLISH_TRIES, Finisher, Published
from .folders import HEARTBEAT, check_writable, create_missing, make_private, queue_lock
from .formats import FileRejected, Request
from .fsutil import crashpoint
from .intake import Inbox, Job
from .late import LateLines
from .ledger import EventLog, FailureLog
from .metrics import Metrics, output_tokens, peak_memory_mb
from .pool import Done, Pool, as_pool
from .publish import Publisher, line_failure, request_failure
from .reading import Snapshot, read_claimed
from .status import Heartbeat
from .turns import Turns, is_test

log = logging.getLogger(__name__)


@dataclass
class RunCounts:
    """What one run of the daemon did, for its summary line and its stop event."""

    files: int = 0  # published or quarantined
    quarantined: int = 0
    results: int = 0
    failures: int = 0  # failure records of this run (a quarantined file has one)


@dataclass(frozen=True)
class Kept:
    """A file a stop left claimed, with its requests that were in flight: it resumes on the next start."""

    file: str
    claim: int
    in_flight: int


class Spool:
    def __init__(
        self,
        cfg: BatchConfig,
        backend_factory: Callable[[], Backend | Pool],
        progress: Callable[[str], None] | None = None,
        on_watching: Callable[[Spool], None] | None = None,
        on_expired: Callable[[Spool, list[Kept]], None] | None = None,
    ) -> None:
        """`progress` gets a line per batch; a daemon (not `once`) calls `on_watching` once it is up and
        watching, before its first batch; `on_expired` gets the files kept claimed when a stop's grace ran
        out, just before the process exits."""
        self.cfg = cfg
        self.f = cfg.folders
        self.backend_factory = backend_factory
        self.pool: Pool | None = None
        self.progress = progress
        self.on_watching = on_watching
        self.on_expired = on_expired
        self.events = EventLog(self.f.logs / "events.jsonl")
        self.lock = queue_lock(cfg)
        self.inbox = Inbox(self.f, cfg.settle_s, self.events)
        self.beat = Heartbeat(self.f.logs / HEARTBEAT)
        self.metrics = Metrics(cfg.metrics_textfile)
        self.wake = signals.Wake()
        self.stopping = False
        self.claimed: dict[int, Job] = {}  # claim number -> job in progress (resumed, decoding or deferred)
        self.quarantines: dict[int, tuple[str, str]] = {}  # claim -> (code, message) of a quarantine put off
        self.flight: dict[int, tuple[list[Item], float]] = {}  # pool ticket -> (batch, start time)
        self.counts = RunCounts()
        self.stop_signal: int | None = None  # the signal that stopped the loop, if one did

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Create missing folders, take the locks, check every folder and the backend, and find claims to
        resume."""
        make_private(self.cfg)  # before anything is written: 0600 files in 0700 folders, unless `private: false`
        self.ensure_folders(at_start=True)
        self.lock.acquire()  # raises LockHeld
        try:
            for key in ("inputs", "outputs", "processed", "logs"):
                check_writable(key, getattr(self.f, key))
            self.failures = FailureLog(self.f.logs / "failed.jsonl")
            self.publisher = Publisher(self.f, self.cfg.output_formats, self.failures, self.events)
            self.late = LateLines(
                self.f.processed / ".late.json",
                self.failures,
                self.events,
                self.cfg.settle_s,
                self.cfg.max_line_bytes,
                self.cfg.late_window_s,
                check_every_s=self.cfg.rescan_s,
            )
            self.finisher = Finisher(
                self.cfg, self.publisher, self.late, self.events, self.metrics, self.prepare, self.ensure_folders
            )
            for folder in (self.f.outputs, self.f.logs):  # our temp files of a publish cut short
                for tmp in folder.glob(".*.tmp"):
                    tmp.unlink(missing_ok=True)
            # a bad model fails now
            self.pool = as_pool(
                self.backend_factory(), self.cfg.request_timeout_s, self.cfg.batch_size, events=self.events
            )
            for job in self.inbox.open(self.failures.max_claim):
                self.claimed[job.seq] = job
        except BaseException:
            self.close_pool()
            self.lock.release()
            raise

    def ensure_folders(self, at_start: bool = False) -> bool:
        """Create the queue's folders that are missing (a fresh root, or one deleted under a running
        daemon), and lock a recreated one again. Returns whether the inbox was recreated."""
        made = create_missing(self.f, self.cfg.private)
        for key, folder in made:
            if not at_start:
                log.warning("%s (%s) was missing; created it again", folder, key)
                self.lock.retake(folder)  # raises LockHeld if another daemon took it meanwhile
            self.events("folder_created", folder=str(folder), key=key, at_start=at_start)
        return any(key == "inputs" for key, _ in made)

    def close_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    @property
    def in_flight(self) -> list[Item]:
        return [item for batch, _ in list(self.flight.values()) for item in batch]

    def run(self, once: bool) -> int:
        """Serve the queue. Returns the exit code: EXIT_OK; EXIT_FAILED in --once mode when failures were
        recorded; EXIT_IO in --once mode when a publish is still refused by the filesystem (the file stays
        claimed) or a claim was (the file stays in the inbox)."""
        self.start()
        self.events("start", pid=os.getpid(), once=once)
        observer = None if once else self._watch()
        installed = signals.install(self._on_signal, self.cfg.shutdown_grace_s, self._grace_expired, self._signal_noted)
        if not once and self.on_watching is not None:
            self.on_watching(self)
        gave_up = False
        try:
            while not self.stopping:
                if self.ensure_folders() and observer is not None:  # the inbox was deleted: watch the new one
                    observer.stop()
                    observer = self._watch()
                self.counts.failures += self.late.check()
                self.retry_deferred()
                ready, waiting = self.inbox.scan()
                resumable = [j for j in self.claimed.values() if j.resumed]
                if ready or resumable:
                    if not once and not resumable and self.cfg.batch_window_s > 0 and len(ready) < self.cfg.batch_size:
                        time.sleep(self.cfg.batch_window_s)  # let a burst of files arrive, then batch them
                        ready, waiting = self.inbox.scan()
                    self.process(ready)
                    continue
                self.beat.write("idle", self)
                self.metrics.queue(self.inbox.depth, self.inbox.oldest_mtime, len(self.claimed))
                self.metrics.write()
                if once and not waiting and not self.claimed:
                    break
                if once and self.claimed and self.finisher.gave_up(list(self.claimed.values()), ONCE_PUBLISH_TRIES):
                    gave_up = True
                    break
                delay = self.cfg.rescan_s if not waiting else min(self.cfg.rescan_s, self.cfg.settle_s / 2 + 0.05)
                if self.claimed:
                    delay = max(0.01, min(delay, self.finisher.next_due(list(self.claimed.values())) - time.time()))
                self.wake.wait(delay)
                self.wake.clear()
        finally:
            self.stop_claims([])
            self.close_pool()
            if observer is not None:
                observer.stop()
                observer.join(timeout=5)
            self.events("stop", pid=os.getpid(), done=self.counts.results, failed=self.counts.failures, reason="done")
            self.beat.write("stopped", self)
            self.metrics.queue(self.inbox.depth, self.inbox.oldest_mtime, len(self.claimed))
            self.metrics.write(force=True)
            self.lock.release()
            signals.restore(installed)
        if gave_up or (once and self.inbox.refused):
            return EXIT_IO
        return EXIT_FAILED if once and self.counts.failures else EXIT_OK

    def _watch(self) -> Any:
        return signals.watch(self.f.inputs, self.wake)

    def _on_signal(self, signum: int) -> None:
        """In the signal handler: flags and the wake only (see `signals`)."""
        self.stop_signal = signum
        self.stopping = True
        self.wake.set()

    def _signal_noted(self, signum: int) -> None:
        self.events("signal", signal=signum, grace_s=self.cfg.shutdown_grace_s)

    def _grace_expired(self) -> None:
        try:
            kept = self.stop_claims(self.in_flight)
            done, failed = self.counts.results, self.counts.failures
            self.events("stop", pid=os.getpid(), done=done, failed=failed, reason="grace_expired")
            self.beat.write("stopped", self)
            if self.on_expired is not None:
                self.on_expired(self, kept)
        finally:
            os._exit(0)

    def stop_claims(self, in_flight: list[Item]) -> list[Kept]:
        """A clean stop: claimed files stay in the work folder; their journals say what was in flight (a
        stop is no evidence against those requests: `poison`). Returns the files kept."""
        kept = []
        for job in list(self.claimed.values()):
            if job.path.exists():
                lines = sorted(p.request.line for j, p in in_flight if j is job)
                if job.pending == 0 and job.outcomes:  # decided, waiting to publish: keep the outcomes
                    job.journal.append({"outcomes": list(job.outcomes.values())})
                job.journal.append({"stopped": lines})
                self.events("kept_claimed", file=job.name, claim=job.seq, in_flight=len(lines))
                kept.append(Kept(job.name, job.seq, len(lines)))
        self.claimed.clear()
        return kept

    # -- processing --------------------------------------------------------------------------------
    def process(self, paths: list[Path]) -> None:
        self.drain(self.take(paths))

    def take(self, paths: list[Path], budget: int | None = None) -> list[Item]:
        """Claim and read files (resumed ones first, then `paths`, up to `budget` requests, a round's by
        default); returns their requests to decode (and publishes a file with nothing left to decode)."""
        budget = self.cfg.batch_size * 8 if budget is None else budget  # bounds memory and latency
        jobs = []
        taken = 0
        resumed = []
        for job in [j for j in self.claimed.values() if j.resumed]:
            loaded = self.load(job)
            job.resumed = False
            if loaded:  # not quarantined, gone, or waiting for room to be quarantined
                jobs.append(job)
                resumed.append(job)
                taken += len(job.requests)
        for path in paths:
            if self.stopping or taken >= budget:
                break
            try:
                new = self.inbox.claim(path)
            except OSError as e:  # a folder deleted under us, or a move the filesystem refuses
                log.warning("cannot claim %s: %s; trying again later", path.name, e)
                self.events("claim_failed", file=path.name, error=str(e))
                self.inbox.refuse(path.name)
                continue
            if new is not None:
                self.claimed[new.seq] = new
                if self.load(new):
                    jobs.append(new)
                    taken += len(new.requests)
        work = [item for job in jobs for item in self.prepare(job, job.requests)]
        for job in resumed:  # a death from now on finds it waiting for its turn, not being read (`journal`)
            job.journal.append({"prepared": True})
        return work + self.complete([job for job in jobs if job.pending == 0 and job.seq in self.claimed])

    def drain(self, work: list[Item]) -> None:
        """Run `work`, up to `pool.slots` batches at once, in fair turns (`turns`). While batches are in
        flight, files that arrive are claimed and take their turn beside the files already claimed, up to
        one round's budget more, after which the loop's other duties come first. On a stop nothing new
        starts (not even the halves of a failed batch) and the batches in flight are finished."""
        assert self.pool is not None
        turns = Turns()
        turns.add(self.pack(work))
        first = True
        more = self.cfg.batch_size * 8  # requests this drain may claim while it runs
        while (turns and not self.stopping) or self.flight:
            if not self.stopping and more > 0:
                more -= self.arrivals(turns, more)
            while not self.stopping and len(self.flight) < self.pool.slots and not self.testing:
                batch = turns.next(idle=not self.flight)
                if batch is None:
                    break
                self.submit(batch)
            if not self.flight:
                break
            for done in self.pool.wait():
                halves, new = self.finished(done)
                turns.halves(halves)  # bisection first: it holds decided work back
                turns.add(self.pack(new))
                if first:
                    crashpoint("mid_batch")  # other batches may still be in flight
                    first = False

    @property
    def testing(self) -> bool:
        """Whether a suspect's test is in flight: nothing starts beside it."""
        return any(is_test(batch) for batch, _ in self.flight.values())

    def arrivals(self, turns: Turns, more: int) -> int:
        """Claim files that arrived while batches run, in arrival order: while fewer than a round of rows
        wait to start, up to that round (they are packed together); beyond it, one file at a time, when no
        claimed file is still waiting for its first turn. So a small file arriving behind big ones is
        claimed within a turn or two. Returns the requests claimed."""
        room = self.cfg.batch_size * 8 - turns.rows
        if room <= 0 and turns.unstarted():
            return 0
        ready, _ = self.inbox.scan()
        if not ready:
            return 0
        new = self.take(ready, min(more, room)) if room > 0 else self.take(ready[:1], 1)
        turns.add(self.pack(new))
        return max(len(new), 1)

    def pack(self, work: list[Item]) -> list[list[Item]]:
        return pack(work, self.cfg.batch_size, self.cfg.token_budget) if work else []

    def load(self, job: Job) -> bool:
        """Parse a claimed file (and, for a resumed one, its journal). Unreadable files are quarantined;
        a file removed while claimed is dropped."""
        try:
            got = read_claimed(job.path, job.name, Snapshot(), self.cfg.settle_s, self.cfg.max_line_bytes)
            if len(got.requests) > self.cfg.max_file_requests:
                raise FileRejected(
                    "too_many_requests",
                    f"{len(got.requests)} requests; the limit per file is {self.cfg.max_file_requests}",
                )
        except FileNotFoundError:  # the claimed file itself: removed by hand (with the work folder, say)
            self.gone(job)
            return False
        except FileRejected as e:
            self.quarantine(job, e.code, e.message)
            return False
        except OSError as e:
            self.quarantine(job, "unreadable", f"cannot read the file: {e}")
            return False
        job.snapshot = got.snapshot
        job.requests = got.requests
        job.failures = [line_failure(job, err) for err in got.errors]
        if job.resumed:
            poison.resume(job, self.cfg.max_claims, self.events)
        return True

    def prepare(self, job: Job, requests: list[Request]) -> list[Item]:
        assert self.pool is not None
        out = []
        for req in requests:
            if req.line in job.outcomes:
                continue  # decided by an earlier claim
            try:
                out.append((job, self.pool.prepare(req)))
            except CelerisError as e:  # the exception's type carries the code
                code, retryable, message = e.code, e.retryable, str(e)
            except Exception as e:  # any other error preparing one request is still only that request's
                code, retryable, message = "prepare_error", False, f"{type(e).__name__}: {e}"
            else:
                continue
            job.outcomes[req.line] = {"line": req.line, "failure": request_failure(job, req, code, message, retryable)}
        job.pending += len(out)
        return out

    def submit(self, batch: list[Item]) -> None:
        """Start one batch on the pool, after journaling which lines are in flight."""
        assert self.pool is not None
        for job in {id(j): j for j, _ in batch}.values():
            mine = [p.request.line for j, p in batch if j is job]
            test = is_test(batch)
            if needs_journal(
                job, undecided_after=job.pending - len(mine), suspect=job.suspects is None or bool(job.suspects)
            ):  # so a death here can be blamed on these lines; on a suspect only if it is tested alone
                job.journal.append({"try": mine, "suspect": True} if test else {"try": mine})
        ticket = self.pool.submit([p for _, p in batch])
        self.flight[ticket] = (batch, time.perf_counter())
        self.events("submit", ticket=ticket, size=len(batch), in_flight=len(self.flight))
        self.beat.write("decoding", self)

    def finished(self, done: Done) -> tuple[list[list[Item]], list[Item]]:
        """A batch is back: a failed batch of several is halved (returns the halves, to run first, so the
        request at fault fails alone); otherwise its outcomes are recorded. Also returns new work (lines
        appended to a file meanwhile)."""
        batch, t0 = self.flight.pop(done.ticket)
        halves, outcomes = settle(batch, done.bodies, done.error)
        if halves:
            assert done.error is not None
            self.events("bisect", ticket=done.ticket, size=len(batch), error=describe(done.error)[2])
            return halves, []
        return [], self.record_batch(done.ticket, batch, outcomes, t0)

    def record_batch(self, ticket: int, batch: list[Item], outcomes: list[Decided[Item]], t0: float) -> list[Item]:
        jobs = {id(j): j for j, _ in batch}
        wall = time.perf_counter() - t0
        failed = [o for o in outcomes if o.body is None]
        tokens = sum(o.item[1].cost for o in outcomes)
        out_tokens = sum(output_tokens(o.body) for o in outcomes if o.body is not None)
        peak = max((peak_memory_mb(o.body) for o in outcomes if o.body is not None), default=0.0)
        self.metrics.batch(out_tokens, wall, peak)
        self.beat.peak_memory_mb = peak or self.beat.peak_memory_mb
        self.events(
            "batch",
            ticket=ticket,
            size=len(batch),
            tokens=tokens,
            wall_s=round(wall, 4),
            files=sorted({job.name for job, _ in batch}),
            failed=len(failed),
            **({"prompts": [(p.request.prompt or "")[:200] for _, p in batch]} if self.cfg.log_prompts else {}),
        )
        if self.progress:
            self.progress(
                f"batch: {len(jobs)} file{'s' if len(jobs) != 1 else ''}, {len(batch)} request"
                f"{'s' if len(batch) != 1 else ''}, {out_tokens / max(wall, 1e-9):.1f} tok/s, "
                f"{len(failed)} failed"
            )
        self.beat.last_batch = time.time()
        for job in jobs.values():
            self.record(job, [o for o in outcomes if o.item[0] is job])
        work = self.complete([job for job in jobs.values() if job.pending == 0])
        self.beat.write("busy", self)
        self.metrics.queue(self.inbox.depth, self.inbox.oldest_mtime, len(self.claimed))
        self.metrics.write()
        return work

    def record(self, job: Job, outcomes: list[Decided[Item]]) -> None:
        new: list[dict[str, Any]] = []
        for o in outcomes:
            req = o.item[1].request
            if o.body is not None:
                new.append({"line": req.line, "body": o.body})
            else:
                new.append({"line": req.line, "failure": request_failure(job, req, o.code, o.message, o.retryable)})
        for rec in new:
            job.outcomes[rec["line"]] = rec
        job.pending -= len(outcomes)
        if new and needs_journal(job, undecided_after=job.pending, suspect=any("failure" in r for r in new)):
            job.journal.append({"outcomes": new})  # decided once: a rerun never decodes these again

    # -- publishing --------------------------------------------------------------------------------
    def complete(self, jobs: list[Job]) -> list[Item]:
        if not jobs:
            return []
        done = self.finisher.complete(jobs)
        self.published(done.published)
        return done.work

    def published(self, published: list[Published]) -> None:
        for p in published:
            self.claimed.pop(p.job.seq, None)
            self.inbox.release(p.job)
            self.counts.results += p.results
            self.counts.failures += p.failures
            self.counts.files += 1

    def retry_deferred(self) -> None:
        now = time.time()
        idle = [j for j in self.claimed.values() if not j.resumed and j.pending == 0]
        due = self.finisher.due(idle, now)
        to_quarantine = [j for j in due if j.seq in self.quarantines]
        for job in to_quarantine:
            self.quarantine(job, *self.quarantines[job.seq])
        self.drain(self.complete([j for j in due if j not in to_quarantine]))

    def quarantine(self, job: Job, code: str, message: str) -> None:
        """Quarantine a file that cannot be read, with its record. One the filesystem refuses (a full disk,
        a folder deleted under it) stays claimed and is tried again later with back-off, as a publish is."""
        try:
            self.publisher.quarantine(job, code, message)
        except OSError as e:
            if not os.path.lexists(job.path):
                self.gone(job)
                return
            self.finisher.blocked_or_raise(job, e)
            self.quarantines[job.seq] = (code, message)
            return
        self.metrics.published(0, [code])
        self.drop_claim(job)
        self.counts.failures += 1
        self.counts.files += 1
        self.counts.quarantined += 1

    def gone(self, job: Job) -> None:
        """A claimed file removed by hand before it was read: nothing of it is left to serve or record."""
        log.warning("%s (claim %d) was removed while claimed; dropping the claim", job.name, job.seq)
        self.events("gone", file=job.name, claim=job.seq)
        job.journal.remove()
        self.drop_claim(job)

    def drop_claim(self, job: Job) -> None:
        self.claimed.pop(job.seq, None)
        self.quarantines.pop(job.seq, None)
        self.finisher.forget(job)
        self.inbox.release(job)


def needs_journal(job: Job, undecided_after: int, suspect: bool) -> bool:
    """Whether a step of `job` must be journaled. Not when the file is decided in one batch that cannot
    be blamed for anything: a crash before its publish redoes that one batch, and the common small file
    costs no fsync. It must be when the journal already exists (it has to stay whole), when requests stay
    undecided after this step (a restart must know what is decided), and when the step involves suspects
    (lines in flight at an earlier death, decoded alone) or failures (decided for good: never decode
    them again, so a rerun cannot turn a recorded failure into a result)."""
    return job.journal.exists or undecided_after > 0 or suspect
