"""The spool daemon: inbox -> claim -> batch -> publish -> processed, with no lost work.

State lives in the folders (Maildir, Postfix qmgr):
- a file is claimed by renaming it into `inputs/.work/`; at startup, anything there goes back to the inbox;
- results are published with temp-write, fsync, rename, directory fsync, under a name derived from the
  claimed file name, so a rerun after a crash overwrites instead of duplicating;
- failures are appended to `logs/failed.jsonl` with a stable key, so a rerun does not repeat them;
- the input moves to `processed/` only after its results and failures are durable.

Watchdog events only wake the loop; the loop also rescans every `rescan_s`. Intake, publishing and
signals live in their own modules; this one runs the loop and the batches.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CelerisError
from . import signals
from .backend import Backend, Prepared
from .config import BatchConfig
from .formats import FileRejected, parse_file
from .fsutil import QueueLock, atomic_write, crashpoint
from .intake import Inbox, Job
from .ledger import EventLog, FailureLog, now_iso
from .publish import Publisher, line_failure, request_failure

log = logging.getLogger(__name__)

LOCK_NAME = ".celeris.lock"
HEARTBEAT = "heartbeat.json"


class Spool:
    def __init__(self, cfg: BatchConfig, backend_factory: Callable[[], Backend]) -> None:
        self.cfg = cfg
        self.f = cfg.folders
        self.backend_factory = backend_factory
        self.backend: Backend | None = None
        self.events = EventLog(self.f.logs / "events.jsonl")
        self.lock = QueueLock(cfg.root / LOCK_NAME)
        self.inbox = Inbox(self.f, cfg.settle_s, self.events)
        self.wake = threading.Event()
        self.stopping = False
        self.claimed: dict[str, Job] = {}
        self.failed_this_run = 0
        self.done_this_run = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the lock, recover the work folder, load the failure log."""
        self.lock.acquire()  # raises LockHeld
        self.f.work.mkdir(exist_ok=True)
        self.f.quarantine.mkdir(exist_ok=True)
        self.failures = FailureLog(self.f.logs / "failed.jsonl")
        self.publisher = Publisher(self.f, self.cfg.output_formats, self.failures, self.events)
        self.inbox.recover()
        # our own temp files of a publish cut short (the inbox's dot-files belong to producers: left alone)
        for folder in (self.f.outputs, self.f.logs):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)

    def run(self, once: bool) -> int:
        """Serve the queue. Returns the exit code: 0, or 1 in --once mode when failures were recorded."""
        self.start()
        self.events("start", pid=os.getpid(), once=once)
        observer = None if once else self._watch()
        previous = signals.install(self._on_signal, self.cfg.shutdown_grace_s, self._grace_expired)
        try:
            while not self.stopping:
                ready, waiting = self.scan()
                if ready:
                    if not once and self.cfg.batch_window_s > 0 and len(ready) < self.cfg.batch_size:
                        time.sleep(self.cfg.batch_window_s)  # let a burst of files arrive, then batch them
                        ready, waiting = self.scan()
                    self.process(ready)
                    continue
                self.heartbeat("idle")
                if once and not waiting:
                    break
                delay = self.cfg.rescan_s if not waiting else min(self.cfg.rescan_s, self.cfg.settle_s / 2 + 0.05)
                self.wake.wait(delay)
                self.wake.clear()
        finally:
            self.requeue()
            if observer is not None:
                observer.stop()
                observer.join(timeout=5)
            self.events("stop", pid=os.getpid(), done=self.done_this_run, failed=self.failed_this_run)
            self.heartbeat("stopped")
            self.lock.release()
            signals.restore(previous)
        return 1 if once and self.failed_this_run else 0

    def scan(self) -> tuple[list[Path], int]:
        return self.inbox.scan()

    def _watch(self) -> Any:
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover - watchdog is a dependency; rescans still work without it
            return None
        wake = self.wake

        class Wake(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                wake.set()

        observer = Observer()
        observer.schedule(Wake(), str(self.f.inputs), recursive=False)
        observer.daemon = True
        observer.start()
        return observer

    def _on_signal(self, signum: int) -> None:
        self.stopping = True
        self.wake.set()
        self.events("signal", signal=signum, grace_s=self.cfg.shutdown_grace_s)

    def _grace_expired(self) -> None:
        self.requeue()
        self.events("grace_expired")
        os._exit(0)

    def requeue(self) -> None:
        """Give claimed but unfinished files back to the inbox."""
        self.inbox.requeue(list(self.claimed.values()))
        self.claimed.clear()

    def heartbeat(self, state: str) -> None:
        data = {
            "pid": os.getpid(),
            "time": now_iso(),
            "unix": time.time(),
            "state": state,
            "done": self.done_this_run,
            "failed": self.failed_this_run,
        }
        try:
            atomic_write(self.f.logs / HEARTBEAT, json.dumps(data).encode())
        except OSError as e:
            log.warning("heartbeat: %s", e)

    # -- processing --------------------------------------------------------------------------------
    def process(self, paths: list[Path]) -> None:
        if self.backend is None:
            self.backend = self.backend_factory()
        budget = self.cfg.batch_size * 8  # requests claimed per round bounds memory and latency
        jobs: list[Job] = []
        claimed = 0
        for path in paths:
            if self.stopping or claimed >= budget:
                break
            job = self.inbox.claim(path)
            if job is not None and self.load(job):
                jobs.append(job)
                claimed += len(job.requests)
        prepared = [(job, p) for job in jobs for p in self.prepare(job)]
        for job in jobs:
            if job.pending == 0:
                self.finish(job)
        for i, batch in enumerate(self.batches(prepared)):
            if self.stopping:
                break
            self.run_batch(batch)
            if i == 0:
                crashpoint("mid_batch")
        if self.stopping:
            self.requeue()

    def load(self, job: Job) -> bool:
        """Parse a claimed file. Unreadable files are quarantined; returns False for those."""
        self.claimed[job.name] = job
        try:
            st = os.lstat(job.path)
            if stat.S_ISLNK(st.st_mode):
                raise FileRejected("symlink", "symlinks in the inbox are not followed; publish a regular file")
            if not stat.S_ISREG(st.st_mode):
                raise FileRejected("not_a_file", "only regular files are read")
            requests, errors = parse_file(job.name, job.path.read_bytes(), self.cfg.max_line_bytes)
            if len(requests) > self.cfg.max_file_requests:
                raise FileRejected(
                    "too_many_requests", f"{len(requests)} requests; the limit per file is {self.cfg.max_file_requests}"
                )
        except FileRejected as e:
            self.quarantine(job, e.code, e.message)
            return False
        except OSError as e:
            self.quarantine(job, "unreadable", f"cannot read the file: {e}")
            return False
        job.requests = requests
        for err in errors:
            job.failures.append(line_failure(job, err))
        return True

    def prepare(self, job: Job) -> list[Prepared]:
        assert self.backend is not None
        out = []
        for req in job.requests:
            try:
                out.append(self.backend.prepare(req))
            except CelerisError as e:
                job.failures.append(request_failure(job, req, e.code, str(e), retryable=e.retryable))
        job.pending = len(out)
        return out

    def batches(self, prepared: list[tuple[Job, Prepared]]) -> list[list[tuple[Job, Prepared]]]:
        """Group compatible requests; cap each batch by size and by padded canvas tokens. Within a group
        requests are sorted by length, so rows of a batch are of similar length (little padding)."""
        groups: dict[Any, list[tuple[Job, Prepared]]] = {}
        for item in prepared:
            groups.setdefault(item[1].group, []).append(item)
        out: list[list[tuple[Job, Prepared]]] = []
        for members in groups.values():
            members.sort(key=lambda item: item[1].cost)
            batch: list[tuple[Job, Prepared]] = []
            for item in members:
                # sorted by cost, so this row is the longest: the padded batch is cost * rows
                if batch and (
                    len(batch) >= self.cfg.batch_size or item[1].cost * (len(batch) + 1) > self.cfg.token_budget
                ):
                    out.append(batch)
                    batch = []
                batch.append(item)
            if batch:
                out.append(batch)
        return out

    def run_batch(self, batch: list[tuple[Job, Prepared]]) -> None:
        assert self.backend is not None
        t0 = time.perf_counter()
        try:
            bodies = self.backend.run([p for _, p in batch])
            error = None
        except Exception as e:  # one failing batch must not stop the daemon; its requests can be retried
            log.exception("batch failed")
            bodies, error = [], f"{type(e).__name__}: {e}"
        wall = time.perf_counter() - t0
        self.events(
            "batch",
            size=len(batch),
            tokens=sum(p.cost for _, p in batch),
            wall_s=round(wall, 4),
            files=sorted({job.name for job, _ in batch}),
            error=error,
            **({"prompts": [(p.request.prompt or "")[:200] for _, p in batch]} if self.cfg.log_prompts else {}),
        )
        for i, (job, p) in enumerate(batch):
            if error is None:
                job.bodies[p.request.custom_id] = bodies[i]
            else:
                job.failures.append(request_failure(job, p.request, "engine_error", error, retryable=True))
            job.pending -= 1
            if job.pending == 0:
                self.finish(job)
        self.heartbeat("busy")

    # -- publishing --------------------------------------------------------------------------------
    def finish(self, job: Job) -> None:
        results, failures = self.publisher.finish(job)
        self.claimed.pop(job.name, None)
        self.done_this_run += results
        self.failed_this_run += failures

    def quarantine(self, job: Job, code: str, message: str) -> None:
        self.publisher.quarantine(job, code, message)
        self.claimed.pop(job.name, None)
        self.failed_this_run += 1
