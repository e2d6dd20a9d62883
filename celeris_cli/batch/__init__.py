"""`celeris batch`: one input file in, one results file and one failure file out, the way `vllm run-batch`
users expect, on the local engine or on a Ray actor pool.

It reads the queue's request lines (`spool.formats`) and writes the queue's result and failure shapes, so
a file moves between `celeris batch`, `celeris watch` and `celeris retry` unchanged. Every request ends as
exactly one result line (input order, matched by `custom_id`) or one self-contained failure record. No
torch here: executors load the engine where they run.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import CelerisError, UsageError
from ..spool.formats import FileRejected, LineError, Request, parse_file, result_line
from ..spool.fsutil import atomic_write, crashpoint
from ..spool.ledger import failure_of_line, failure_of_request
from .journal import BatchJournal, input_identity, journal_path, remove_stale_temps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What became of one request: a response body, or a failure (code, message, retryable)."""

    request: Request
    body: dict[str, Any] | None = None
    code: str | None = None
    message: str | None = None
    retryable: bool = False


class Executor(Protocol):
    def run(self, requests: list[Request], done: frozenset[int] = frozenset()) -> Iterator[list[Outcome]]:
        """One Outcome per request, grouped by finished batch, batches in any order. The requests are
        packed as if none were done; a batch whose every line is in `done` is skipped (finished by an
        earlier run), so a resumed run decodes the rest with the same batch mates as an uninterrupted one."""
        ...


@dataclass(frozen=True)
class BatchReport:
    requests: int
    results: int
    failures: int
    wall_s: float
    output: str
    failed: str
    resumed: int = 0  # requests finished by an earlier, interrupted run (read from the journal)

    @property
    def prompts_per_s(self) -> float:
        return round(self.results / self.wall_s, 2) if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "prompts_per_s": self.prompts_per_s}


def read_requests(path: Path, data: bytes, max_line_bytes: int = 1_000_000) -> tuple[list[Request], list[LineError]]:
    """Requests of an input file and the errors of the lines that are not one."""
    try:
        return parse_file(path.name, data, max_line_bytes)
    except FileRejected as e:
        raise UsageError(f"{path}: {e.message}") from None


def run_file(
    source: Path,
    output: Path,
    failed: Path,
    executor: Executor,
    on_progress: Callable[[int, int], None] | None = None,  # (answers done, lines in all), from the start
    settings: dict[str, Any] | None = None,
    restart: bool = False,
    on_resume: Callable[[int], None] | None = None,  # the requests an interrupted run finished, before any work
) -> BatchReport:
    """Run every request of `source` and publish `output` (results, input order) and `failed` (failure
    records), each written to a temp name and renamed, so a crash leaves no half-written file.

    Each finished batch is journaled beside `output` first (`journal.py`); a rerun after a crash skips
    what is journaled when the input and `settings` (what decides the answers) are unchanged."""
    t0 = time.perf_counter()
    for path in (output, failed):  # before any decoding, not after an hour of it
        if not path.parent.is_dir():
            raise UsageError(f"{path}: folder {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK):
            raise UsageError(f"{path}: folder {path.parent} is not writable")
    try:
        data = source.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {source}: {e.strerror or e}") from None
    requests, errors = read_requests(source, data)
    journal = BatchJournal(journal_path(output))
    try:
        finished = journal.open(input_identity(source, data), settings or {}, restart)
        resumed = len(finished.lines)
        if resumed:
            remove_stale_temps([output, failed])
            if on_resume is not None:
                on_resume(resumed)
        if errors and not finished.lines & {e.line for e in errors}:  # one run, one arrival: claim 0
            unread = {err.line: failure_of_line(source.name, 0, err) for err in errors}
            journal.append([], list(unread.values()), sorted(unread))
            finished.failures.update(unread)
        total = len(requests) + len(errors)  # every line ends as one answer: a result or a failure
        if on_progress is not None:
            on_progress(len(finished.lines), total)
        for batch in executor.run(requests, frozenset(finished.lines)):
            new = [oc for oc in batch if oc.request.line not in finished.lines]
            res = {oc.request.line: result_line(source.name, oc.request, oc.body) for oc in new if oc.body is not None}
            bad = {oc.request.line: _failure(source.name, oc) for oc in new if oc.body is None}
            journal.append(list(res.values()), list(bad.values()), sorted(res | bad))  # fsynced first
            finished.results.update(res)
            finished.failures.update(bad)
            if on_progress is not None:
                on_progress(len(finished.lines), total)
    except OSError as e:
        raise CelerisError(f"cannot write the journal {journal.path}: {e}") from None
    if len(finished.lines) != total:  # an invariant, not a user error
        raise RuntimeError(f"{len(finished.lines)} requests finished of {total}")
    lines = [finished.results[line] for line in sorted(finished.results)]
    # the queue's records name a results file in its outputs folder; this run's results are at `output`
    failures = [{**finished.failures[line], "output": str(output.resolve())} for line in sorted(finished.failures)]
    try:
        atomic_write(failed, _jsonl(failures))
        crashpoint("failed-written")
        atomic_write(output, _jsonl(lines), crash_name="output-staged")
        crashpoint("output-written")
        journal.remove()
    except OSError as e:
        raise CelerisError(f"cannot write the results: {e}") from None
    wall = time.perf_counter() - t0
    return BatchReport(total, len(lines), len(failures), round(wall, 3), str(output), str(failed), resumed)


def _failure(source: str, oc: Outcome) -> dict[str, Any]:
    code = oc.code or "engine_error"
    return failure_of_request(source, 0, oc.request, code, oc.message or "", oc.retryable)


def _jsonl(records: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
