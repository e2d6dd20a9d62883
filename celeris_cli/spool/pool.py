"""Where the queue's batches run: a pool takes batches and hands each back when it is done, so the daemon
can keep several in flight (one per Ray actor) and journal each one as it completes.

The in-process engine is the pool with one slot: it decodes a batch when the daemon waits for it, on the
main thread, where `request_timeout_s` (SIGALRM) can interrupt it. A pool never decides what a failure
means: it hands back the exception, and the daemon bisects or records it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .backend import Backend, Prepared
from .batching import deadline
from .formats import Request


@dataclass(frozen=True)
class Done:
    """A finished batch: its response bodies in batch order, or the exception that failed it."""

    ticket: int
    bodies: list[dict[str, Any]] | None = None
    error: BaseException | None = None


@runtime_checkable
class Pool(Protocol):
    slots: int  # batches it runs at once

    def prepare(self, request: Request) -> Prepared:
        """As Backend.prepare: raise CelerisError for a request that can never run."""
        ...

    def submit(self, batch: list[Prepared]) -> int:
        """Start a batch (at most `slots` in flight); returns its ticket."""
        ...

    def wait(self) -> list[Done]:
        """Block until at least one batch in flight is done; returns every one that is."""
        ...

    def close(self) -> None: ...


class InlinePool:
    """The in-process engine as a pool of one slot."""

    slots = 1

    def __init__(self, backend: Backend, timeout_s: float | None = None) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.tickets = itertools.count(1)
        self.pending: list[tuple[int, list[Prepared]]] = []

    def prepare(self, request: Request) -> Prepared:
        return self.backend.prepare(request)

    def submit(self, batch: list[Prepared]) -> int:
        assert len(self.pending) < self.slots, "one batch at a time"
        ticket = next(self.tickets)
        self.pending.append((ticket, batch))
        return ticket

    def wait(self) -> list[Done]:
        ticket, batch = self.pending.pop(0)
        try:
            with deadline(self.timeout_s):
                bodies = self.backend.run(batch)
        except Exception as e:  # the daemon decides what it means (bisect, or a failure record)
            return [Done(ticket, error=e)]
        return [Done(ticket, bodies=bodies)]

    def close(self) -> None:
        pass


def as_pool(engine: Backend | Pool, timeout_s: float | None) -> Pool:
    return engine if isinstance(engine, Pool) else InlinePool(engine, timeout_s)
