"""Batching: pack prepared requests into batches, and run one so that a poison request fails alone.

An exception from the backend fails a batch of one; a larger batch is bisected and both halves run
again, so the rest of the batch is served. `request_timeout_s` bounds one run with SIGALRM, which
interrupts the decode loop between two Python steps (main thread only; elsewhere there is no limit).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import CelerisError
from .backend import Backend, Prepared
from .intake import Job

Item = tuple[Job, Prepared]


class RequestTimeout(CelerisError):
    code = "timeout"
    retryable = False


@dataclass(frozen=True)
class Outcome:
    job: Job
    prepared: Prepared
    body: dict[str, Any] | None
    code: str = ""
    message: str = ""
    retryable: bool = False


def pack(items: list[Item], batch_size: int, token_budget: int) -> list[list[Item]]:
    """Group compatible requests; cap each batch by size and by padded canvas tokens. Within a group
    requests are sorted by length, so rows of a batch are of similar length (little padding). Suspect
    requests (in flight when an earlier claim died) go alone."""
    groups: dict[Any, list[Item]] = {}
    out: list[list[Item]] = []
    for item in items:
        job, p = item
        if job.suspects is None or p.request.line in job.suspects:
            out.append([item])
        else:
            groups.setdefault(p.group, []).append(item)
    for members in groups.values():
        members.sort(key=lambda item: item[1].cost)
        batch: list[Item] = []
        for item in members:
            # sorted by cost, so this row is the longest: the padded batch is cost * rows
            if batch and (len(batch) >= batch_size or item[1].cost * (len(batch) + 1) > token_budget):
                out.append(batch)
                batch = []
            batch.append(item)
        if batch:
            out.append(batch)
    return out


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise RequestTimeout(f"ran past request_timeout_s ({seconds:g} s)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_bisecting(
    backend: Backend, batch: list[Item], timeout_s: float | None, stopping: Callable[[], bool], log: Callable[..., None]
) -> list[Outcome]:
    """Outcomes for the requests of `batch` that were decided (fewer when a stop cut a bisection short)."""
    try:
        with deadline(timeout_s):
            bodies = backend.run([p for _, p in batch])
        return [Outcome(job, p, body) for (job, p), body in zip(batch, bodies)]
    except Exception as e:  # one failing request must not stop the daemon nor sink its batch
        if isinstance(e, CelerisError):
            code, retryable = e.code, e.retryable
        else:
            code, retryable = "engine_error", True
        message = str(e) if isinstance(e, CelerisError) else f"{type(e).__name__}: {e}"
        if len(batch) == 1:
            job, p = batch[0]
            return [Outcome(job, p, None, code, message, retryable)]
        log("bisect", size=len(batch), error=message)
        mid = len(batch) // 2
        out = run_bisecting(backend, batch[:mid], timeout_s, stopping, log)
        if not stopping():
            out += run_bisecting(backend, batch[mid:], timeout_s, stopping, log)
        return out
