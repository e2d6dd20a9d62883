"""Batching: pack prepared requests into batches, and decide what a batch back from its pool means
(`settle`, for the queue daemon and `celeris batch` both), so that a poison request fails alone.

An exception from the backend fails a batch of one; a larger batch is bisected and both halves run
again, so the rest of the batch is served. `request_timeout_s` bounds one run with SIGALRM, which
interrupts the decode loop between two Python steps (main thread only; elsewhere there is no limit).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import CelerisError
from .backend import Prepared
from .intake import Job

Item = tuple[Job, Prepared]
T = TypeVar("T")


class RequestTimeout(CelerisError):
    code = "timeout"
    retryable = False


@dataclass(frozen=True)
class Decided(Generic[T]):
    """What became of one item of a batch: a response body, or a failure (code, message, retryable)."""

    item: T
    body: dict[str, Any] | None
    code: str = ""
    message: str = ""
    retryable: bool = False


def pack(items: list[Item], batch_size: int, token_budget: int) -> list[list[Item]]:
    """The queue's batches: suspect requests (in flight when an earlier claim died) a group at a time,
    each test holding one group's lines only (`journal`), in the groups' order; the rest packed by
    settings and length."""
    tests: dict[tuple[int, int], list[Item]] = {}
    rest: list[Item] = []
    for item in items:
        job, p = item
        line = p.request.line
        if job.suspects is not None and line not in job.suspects:
            rest.append(item)
            continue
        group = next((k for k, g in enumerate(job.groups) if line in g), len(job.groups))
        tests.setdefault((job.seq, group), []).append(item)
    out = [
        b for key in sorted(tests) for b in pack_by_group(tests[key], lambda item: item[1], batch_size, token_budget)
    ]
    return out + pack_by_group(rest, lambda item: item[1], batch_size, token_budget)


def pack_by_group(
    items: Sequence[T], prepared: Callable[[T], Prepared], batch_size: int, token_budget: int
) -> list[list[T]]:
    """Group items whose prepared requests may share a batch (equal `group`), sort each group by cost so
    the rows of a batch are of similar length, and cap each batch by rows and by padded canvas tokens."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(prepared(item).group, []).append(item)
    out: list[list[T]] = []
    for members in groups.values():
        members.sort(key=lambda item: prepared(item).cost)
        batch: list[T] = []
        for item in members:
            cost = prepared(item).cost  # sorted by cost: this row is the longest, the padded batch is cost * rows
            if batch and (len(batch) >= batch_size or cost * (len(batch) + 1) > token_budget):
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


def describe(e: BaseException) -> tuple[str, bool, str]:
    """A batch's exception as a failure: (code, retryable, message). The exception's type carries the code;
    anything but a CelerisError is the engine's (`engine_error`, retryable: out of memory, a lost worker)."""
    if isinstance(e, CelerisError):
        return e.code, e.retryable, str(e)
    return "engine_error", True, f"{type(e).__name__}: {e}"


def settle(
    batch: list[T], bodies: list[dict[str, Any]] | None, error: BaseException | None
) -> tuple[list[list[T]], list[Decided[T]]]:
    """A batch back from its pool, as every path that runs batches decides it: failed with several items,
    its two halves to run again (first), so the request at fault fails alone and the rest are served;
    failed alone, that item's failure; otherwise one outcome per item."""
    if error is not None:
        if len(batch) > 1:
            mid = len(batch) // 2
            return [batch[:mid], batch[mid:]], []
        code, retryable, message = describe(error)
        return [], [Decided(batch[0], None, code, message, retryable)]
    assert bodies is not None and len(bodies) == len(batch)
    return [], [Decided(item, body) for item, body in zip(batch, bodies)]
