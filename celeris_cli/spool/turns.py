"""Turns: which batch the daemon starts next, so one file never waits behind another's hundreds of rows,
and suspects are tested with nothing beside them.

Three kinds of batch wait here. The halves of a failed batch go first (they hold decided work back). A
suspects' test (lines of one group that were in flight when the process died, `journal`) starts only when
nothing else is in flight, and nothing starts beside it, so a death during it can be blamed on its lines
alone (halved at the next start, down to one line).
Every other batch takes its turn by the files it serves: the batch of the file that has had the fewest
rows started goes next (a file just claimed has had none), oldest first among equals. This is fair
queuing by rows; its bound is the daemon's, which claims a round's budget of requests per drain and
finishes them before it claims more.
"""

from __future__ import annotations

from collections import deque

from .batching import Item


def is_test(batch: list[Item]) -> bool:
    """Whether a batch is a suspects' test: suspect lines only (`batching.pack` never mixes them with others)."""
    return bool(batch) and all(job.suspects is None or p.request.line in job.suspects for job, p in batch)


class Turns:
    def __init__(self) -> None:
        self.first: deque[list[Item]] = deque()  # halves of failed batches, and suspects' tests
        self.waiting: list[list[Item]] = []  # in the order they were packed
        self.started: dict[int, int] = {}  # claim number -> rows of that file started so far

    def __bool__(self) -> bool:
        return bool(self.first or self.waiting)

    def add(self, batches: list[list[Item]]) -> None:
        for batch in batches:
            (self.first if is_test(batch) else self.waiting).append(batch)
            for job, _ in batch:
                self.started.setdefault(job.seq, 0)

    def halves(self, halves: list[list[Item]]) -> None:
        """The halves of a failed batch: they run before anything else."""
        self.first.extendleft(reversed(halves))

    @property
    def rows(self) -> int:
        """Rows waiting to start."""
        return sum(len(b) for b in self.first) + sum(len(b) for b in self.waiting)

    def unstarted(self) -> bool:
        """Whether a claimed file is still waiting for its first turn."""
        return any(self.started.get(job.seq, 0) == 0 for batch in self.waiting for job, _ in batch)

    def next(self, idle: bool) -> list[Item] | None:
        """The batch to start now, if any: None when the next one is a suspect's test and the pool is not
        `idle` (it waits for the batches in flight to finish)."""
        if self.first:
            if is_test(self.first[0]) and not idle:
                return None
            batch = self.first.popleft()
        elif self.waiting:
            turn = min(range(len(self.waiting)), key=lambda i: min(self.started[j.seq] for j, _ in self.waiting[i]))
            batch = self.waiting.pop(turn)
        else:
            return None
        for job, _ in batch:
            self.started[job.seq] = self.started.get(job.seq, 0) + 1
        return batch
