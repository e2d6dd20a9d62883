"""The spool daemon: inbox -> claim -> batch -> publish -> processed, with no lost work.

State lives in the folders (Maildir, Postfix qmgr):
- a file is claimed by renaming it into `inputs/.work/`; at startup, anything there goes back to the inbox;
- results are published with temp-write, fsync, rename, directory fsync, under a name derived from the
  claimed file name, so a rerun after a crash overwrites instead of duplicating;
- failures are appended to `logs/failed.jsonl` with a stable key, so a rerun does not repeat them;
- the input moves to `processed/` only after its results and failures are durable.

Watchdog events only wake the loop; the loop also rescans every `rescan_s`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CelerisError
from .backend import Backend, Prepared
from .config import BatchConfig
from .formats import FileRejected, LineError, Request, parse_file
from .fsutil import QueueLock, atomic_write, crashpoint, move
from .ledger import EventLog, FailureLog, failure_record, now_iso

log = logging.getLogger(__name__)

LOCK_NAME = ".celeris.lock"
HEARTBEAT = "heartbeat.json"
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


class Spool:
    def __init__(self, cfg: BatchConfig, backend_factory: Callable[[], Backend]) -> None:
        self.cfg = cfg
        self.f = cfg.folders
        self.backend_factory = backend_factory
        self.backend: Backend | None = None
        self.events = EventLog(self.f.logs / "events.jsonl")
        self.lock = QueueLock(cfg.root / LOCK_NAME)
        self.wake = threading.Event()
        self.stopping = False
        self.claimed: dict[str, Job] = {}
        self.seen_sizes: dict[str, tuple[int, float]] = {}
        self.failed_this_run = 0
        self.done_this_run = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the lock, recover the work folder, load the failure log."""
        self.lock.acquire()  # raises LockHeld
        self.f.work.mkdir(exist_ok=True)
        self.f.quarantine.mkdir(exist_ok=True)
        self.failures = FailureLog(self.f.logs / "failed.jsonl")
        self.recover()

    def recover(self) -> None:
        for entry in sorted(self.f.work.iterdir()):
            move(entry, self.f.inputs / entry.name)
            self.events("recovered", file=entry.name)
        # our own temp files of a publish cut short (the inbox's dot-files belong to producers: left alone)
        for folder in (self.f.outputs, self.f.logs):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)

    def run(self, once: bool) -> int:
        """Serve the queue. Returns the exit code: 0, or 1 in --once mode when failures were recorded."""
        self.start()
        self.events("start", pid=os.getpid(), once=once)
        observer = None if once else self._watch()
        previous = self._install_signals()
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
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return 1 if once and self.failed_this_run else 0

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

    def _install_signals(self) -> dict[int, Any]:
        """SIGTERM/SIGINT: stop intake and finish or requeue; a second one exits at once. Returns the
        handlers replaced, to restore them (signals can only be handled on the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: Any) -> None:
            if self.stopping:
                os._exit(128 + signum)  # second signal: at once; startup recovery makes this safe
            self.stopping = True
            self.wake.set()
            self.events("signal", signal=signum, grace_s=self.cfg.shutdown_grace_s)
            timer = threading.Timer(self.cfg.shutdown_grace_s, self._grace_expired)
            timer.daemon = True
            timer.start()

        return {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}

    def _grace_expired(self) -> None:
        self.requeue()
        self.events("grace_expired")
        os._exit(0)

    def requeue(self) -> None:
        """Give claimed but unfinished files back to the inbox."""
        for job in list(self.claimed.values()):
            if job.path.exists():
                move(job.path, self.f.inputs / job.name)
                self.events("requeued", file=job.name)
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

    # -- intake ------------------------------------------------------------------------------------
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
            settled = now - st.st_mtime >= self.cfg.settle_s
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
            job = self.claim(path)
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
            job.failures.append(self._line_failure(job, err))
        return True

    def prepare(self, job: Job) -> list[Prepared]:
        assert self.backend is not None
        out = []
        for req in job.requests:
            try:
                out.append(self.backend.prepare(req))
            except CelerisError as e:
                job.failures.append(self._request_failure(job, req, e.code, str(e), retryable=e.retryable))
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
                job.failures.append(self._request_failure(job, p.request, "engine_error", error, retryable=True))
            job.pending -= 1
            if job.pending == 0:
                self.finish(job)
        self.heartbeat("busy")

    # -- publishing --------------------------------------------------------------------------------
    def finish(self, job: Job) -> None:
        """Failures, then outputs, then the move to processed: each step durable before the next."""
        recorded = 0
        for rec in job.failures:
            recorded += self.failures.append(rec)
        crashpoint("after_failure_append")
        lines = []
        for req in job.requests:
            body = job.bodies.get(req.custom_id)
            if body is not None:
                lines.append(
                    {
                        "id": f"{job.name}:{req.line}",
                        "custom_id": req.custom_id,
                        "response": {"status_code": 200, "body": body},
                        "error": None,
                    }
                )
        out = self.f.outputs / f"{job.name}.results.jsonl"
        atomic_write(
            out,
            "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode(),
            crash_name="after_output_tmp",
        )
        if "txt" in self.cfg.output_formats:
            text = "".join(
                f"[{req.custom_id}]\n{job.bodies[req.custom_id]['text']}\n\n"
                for req in job.requests
                if req.custom_id in job.bodies
            )
            atomic_write(self.f.outputs / f"{job.name}.results.txt", text.encode())
        crashpoint("after_publish")
        move(job.path, self.f.processed / job.name)
        crashpoint("after_move")
        self.claimed.pop(job.name, None)
        self.done_this_run += len(lines)
        self.failed_this_run += len(job.failures)
        self.events(
            "published", file=job.name, results=len(lines), failures=len(job.failures), new_failure_records=recorded
        )

    def quarantine(self, job: Job, code: str, message: str) -> None:
        rec = failure_record(
            source=job.name,
            line=0,
            code=code,
            message=message,
            retryable=False,
            attempt=1,
            request=None,
            custom_id=None,
        )
        self.failures.append(rec)
        move(job.path, self.f.quarantine / job.name)
        self.claimed.pop(job.name, None)
        self.failed_this_run += 1
        self.events("quarantined", file=job.name, code=code)

    def _line_failure(self, job: Job, err: LineError) -> dict[str, Any]:
        return failure_record(
            source=job.name,
            line=err.line,
            code=err.code,
            message=err.message,
            retryable=err.retryable,
            attempt=err.attempt,
            request=err.request,
            custom_id=err.custom_id,
        )

    def _request_failure(self, job: Job, req: Request, code: str, message: str, retryable: bool) -> dict[str, Any]:
        return failure_record(
            source=job.name,
            line=req.line,
            code=code,
            message=message,
            retryable=retryable,
            attempt=req.attempt,
            request=req.body(),
            custom_id=req.custom_id,
            origin=req.origin,
        )


def _ends_with_newline(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return False
