"""Out-of-memory back-off: run a batch of rows so that no row fails because of its batch mates.

`run_backing_off(run, rows)` calls `run` on the largest leading group of rows whose estimated peak fits
the budget (all of them without a budget); when a run raises out of memory, the group is halved and each
half runs again, down to one row. A row that does not fit alone, by its estimate or by running out of
memory, fails alone with `TooLarge`, naming the memory it needed and what to lower. Rows in, one
outcome per row out, in order: it knows nothing of the engine, so a scheduler can call it as well.

Rule 2 of the project (an answer depends only on its request) is what makes splitting safe: a row decoded
in a smaller batch gives the same text.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import TooLarge

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

LOWER = (
    "lower gen_length, the prompt's length or the batch's settings (block_length, cache), or use --quantize int8"
    " or int4"
)


@dataclass(frozen=True)
class Outcome(Generic[R]):
    """One row's result, or why it could not be decoded even alone."""

    value: R | None = None
    error: Exception | None = None  # TooLarge; with `isolate`, whatever the row raised alone


def is_out_of_memory(e: BaseException) -> bool:
    """torch's out-of-memory error (CUDA's, or any device's), without importing torch here."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


def _human(n: int) -> str:
    from .arch.memory_sizes import human

    return human(n)


def run_backing_off(
    run: Callable[[list[T]], list[R]],
    rows: Sequence[T],
    need: Callable[[list[T]], int] | None = None,
    budget: int | None = None,
    is_oom: Callable[[BaseException], bool] = is_out_of_memory,
    release: Callable[[], None] = lambda: None,
    isolate: bool = False,
) -> list[Outcome[R]]:
    """Each row's outcome, in order. `run(group)` returns one result per row of the group; `need(group)`
    estimates its peak in bytes (the memory planner), checked against `budget` before anything runs;
    `release` frees what a failed run left behind (`torch.cuda.empty_cache`) before the retry. `isolate`:
    any other failure is halved the same way, down to the row that raises alone, whose outcome is its error
    (one request's failure does not sink its batch mates); without it, it propagates."""
    out: list[Outcome[R]] = []
    pending: list[list[T]] = [list(rows)] if rows else []
    while pending:
        group = pending.pop(0)
        k = _fitting(group, need, budget)
        if k == 0:
            needed = need([group[0]]) if need is not None else 0
            out.append(Outcome(error=too_large(needed, f"over the budget of {_human(budget or 0)}")))
            pending[:0] = [group[1:]] if len(group) > 1 else []
            continue
        if k < len(group):
            pending[:0] = [group[:k], group[k:]]
            continue
        try:
            out.extend(Outcome(value=r) for r in run(group))
        except Exception as e:
            oom = is_oom(e)
            if not oom and not isolate:
                raise
            if oom:
                release()
            if len(group) == 1:
                needed = need(group) if need is not None and oom else 0
                if not oom:
                    log.warning("decoding failed: %s: %s", type(e).__name__, e)
                out.append(Outcome(error=too_large(needed, "out of memory alone") if oom else e))
                continue
            log.info("%s with %d rows; retrying in halves", "out of memory" if oom else "a failure", len(group))
            mid = len(group) // 2
            pending[:0] = [group[:mid], group[mid:]]
    return out


def _fitting(group: list[T], need: Callable[[list[T]], int] | None, budget: int | None) -> int:
    """How many leading rows of `group` fit the budget together (the estimate grows with the rows)."""
    if need is None or budget is None:
        return len(group)
    return largest_fitting(len(group), lambda k: need(group[:k]) <= budget)


def largest_fitting(most: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 0..most with fits(n), for a `fits` true up to some n and false beyond (memory that
    grows with the rows): the one "how many fit" search, by bisection; 0 when not even one fits."""
    if fits(most):
        return most
    lo, hi = 0, most - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def too_large(needed: int, why: str) -> TooLarge:
    """The error of a row that does not fit alone: the memory it needed, why, and what to lower."""
    about = f"needs about {_human(needed)}" if needed else "does not fit"
    return TooLarge(f"request too large for this device's memory: it {about} alone ({why}); {LOWER}")
