"""Where the queue's batches run: a pool takes batches and hands each back when it is done, so the daemon
can keep several in flight (one per Ray actor) and journal each one as it completes.

The in-process engine is a running set (`RunningPool`, `Engine.live`): batches submitted while others
decode join their running set as rows leave, so a file claimed meanwhile is admitted while another file's
batch is still running, and the set stays full. It decodes when the daemon waits, on the main thread, and
hands back each batch as its last row finishes; under a memory budget the running set is as wide as
fits. With `request_timeout_s` (SIGALRM around one batch) it is the pool of one slot that decodes a batch
at a time (`InlinePool`), as is any backend that is not the engine. A pool never decides what a failure means: it
hands back the exception, and the daemon bisects or records it.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .backend import Backend, EngineBackend, Prepared, body_of
from .batching import Decided, deadline, describe, settle
from .formats import Request

log = logging.getLogger(__name__)


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


class RunningPool:
    """The in-process engine's running set as a pool: `submit` adds a batch's rows to it (they wait behind
    the rows already there), `wait` decodes until every row of some batch is answered and hands back each
    batch that is, the others staying in flight. A batch whose settings cannot join a running set
    (guidance, strategies other than block-fast and fast, another `deterministic`) decodes on its own, taking turns
    with the running set. If the running set raises (not out of memory: it narrows itself), each batch in it
    decodes again on its own, so only the batch at fault fails (and the daemon halves it); that fallback is
    logged as a warning with the exception and recorded as a `running_set_failed` event."""

    slots = 3  # batches in flight: the next ones wait their turn inside the running set, so it stays full

    def __init__(self, backend: EngineBackend, max_batch: int, events: Callable[..., None] | None = None) -> None:
        self.backend = backend
        self.events = events  # the queue's event log
        self.live = backend.engine.live(max_batch)
        self.tickets = itertools.count(1)
        self.keys = itertools.count()
        self.rows: dict[int, tuple[int, int]] = {}  # row key -> (ticket, place in its batch)
        self.open: dict[int, list[dict[str, Any] | None]] = {}  # ticket -> bodies so far, in batch order
        self.failed: dict[int, BaseException] = {}  # ticket -> a row's failure (too large alone)
        self.batches: dict[int, list[Prepared]] = {}  # ticket -> its batch, while in the running set
        self.alone: deque[tuple[int, list[Prepared]]] = deque()  # batches that decode on their own
        self.answers: Generator[tuple[int, Any], None, None] | None = None
        self.turn_alone = False  # alone batches and the running set take turns

    def prepare(self, request: Request) -> Prepared:
        return self.backend.prepare(request)

    def submit(self, batch: list[Prepared]) -> int:
        ticket = next(self.tickets)
        params = batch[0].group  # final: one batch shares its settings
        if not self.live.accepts(params):
            self.alone.append((ticket, batch))
            return ticket
        self.open[ticket] = [None] * len(batch)
        self.batches[ticket] = batch
        for place, p in enumerate(batch):
            key = next(self.keys)
            self.rows[key] = (ticket, place)
            text, ids, seed = p.payload
            self.live.add(key, text, ids, params, seed)
        return ticket

    def wait(self) -> list[Done]:
        if self.alone and (self.turn_alone or not self.open):
            self.turn_alone = False
            ticket, batch = self.alone.popleft()
            try:
                return [Done(ticket, bodies=self.backend.run(batch))]
            except Exception as e:  # the daemon decides what it means
                return [Done(ticket, error=e)]
        self.turn_alone = bool(self.alone)
        done: list[Done] = []
        try:
            while not done and self.open:
                if self.answers is None:
                    assert self.live.pending, "batches in flight with no row in the running set"
                    self.answers = self.live.answers()
                answer = next(self.answers, None)
                if answer is None:  # that run ended; rows added at its last answer start the next
                    self.answers = None
                    continue
                key, result = answer
                ticket, place = self.rows.pop(key)
                bodies = self.open[ticket]
                if isinstance(result, BaseException):  # the batch fails for it; the daemon's halves find it
                    self.failed.setdefault(ticket, result)
                    bodies[place] = {}
                else:
                    bodies[place] = body_of(result)
                if all(b is not None for b in bodies):
                    del self.open[ticket], self.batches[ticket]
                    error = self.failed.pop(ticket, None)
                    good = [b for b in bodies if b is not None]
                    done.append(Done(ticket, error=error) if error is not None else Done(ticket, bodies=good))
        except Exception as e:  # the running set failed: each of its batches again on its own, to find the one at fault
            tickets = sorted(self.open)
            log.warning(
                "the running set failed (%s); decoding its %d batches again one at a time",
                describe(e)[2],
                len(tickets),
                exc_info=True,
            )
            if self.events is not None:
                self.events("running_set_failed", error=describe(e)[2], tickets=tickets)
            self.answers = None
            self.alone.extend((ticket, self.batches[ticket]) for ticket in tickets)
            self.open.clear()
            self.batches.clear()
            self.rows.clear()
            self.failed.clear()
        return done

    def close(self) -> None:
        if self.answers is not None:
            self.answers.close()
            self.answers = None


def as_pool(
    engine: Backend | Pool,
    timeout_s: float | None,
    max_batch: int = 16,
    running: bool = True,
    events: Callable[..., None] | None = None,
) -> Pool:
    """The pool a backend runs batches on: itself if it is one (Ray), the engine's running set where nothing
    asks for one batch at a time (`running`, a per-batch timeout), otherwise one batch at a time. `events`
    records what the pool does that the daemon cannot see (the running set's fallback)."""
    if isinstance(engine, Pool):
        return engine
    if running and timeout_s is None and isinstance(engine, EngineBackend):
        return RunningPool(engine, max_batch, events)
    return InlinePool(engine, timeout_s)


def run_batches(
    pool: Pool, batches: Iterable[list[Prepared]], log: Callable[..., None]
) -> Iterator[list[Decided[Prepared]]]:
    """Every batch through `pool`, at most `pool.slots` in flight, as the queue daemon runs them: a failed
    batch of several is halved (`batching.settle`) and its halves run next, so the request at fault fails
    alone. Yields each batch's outcomes once every item of it is decided, whole (the journal of `celeris
    batch` records batches whole)."""
    todo: deque[tuple[int, list[Prepared]]] = deque(enumerate(batches))
    left = {root: len(batch) for root, batch in todo}  # items of each batch not decided yet
    decided: dict[int, list[Decided[Prepared]]] = {}
    flight: dict[int, tuple[int, list[Prepared]]] = {}  # ticket -> (its batch, this part of it)
    while todo or flight:
        while todo and len(flight) < pool.slots:
            root, part = todo.popleft()
            flight[pool.submit(part)] = (root, part)
        for done in pool.wait():
            root, part = flight.pop(done.ticket)
            halves, outcomes = settle(part, done.bodies, done.error)
            if halves:
                assert done.error is not None
                log("bisect", size=len(part), error=describe(done.error)[2])
                todo.extendleft((root, half) for half in reversed(halves))
                continue
            decided.setdefault(root, []).extend(outcomes)
            left[root] -= len(outcomes)
            if not left[root]:
                yield decided.pop(root)
