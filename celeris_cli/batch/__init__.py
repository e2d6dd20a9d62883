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
from ..spool.formats import FileRejected, Request, parse_file, result_line
from ..spool.fsutil import atomic_write
from ..spool.ledger import failure_of_line, failure_of_request

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
    def run(self, requests: list[Request]) -> Iterator[Outcome]:
        """One Outcome per request, in any order."""
        ...


@dataclass(frozen=True)
class BatchReport:
    requests: int
    results: int
    failures: int
    wall_s: float
    output: str
    failed: str

    @property
    def prompts_per_s(self) -> float:
        return round(self.results / self.wall_s, 2) if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "prompts_per_s": self.prompts_per_s}


def read_requests(path: Path, max_line_bytes: int = 1_000_000) -> tuple[list[Request], list[dict[str, Any]]]:
    """Requests of an input file and a failure record for each line that is not one."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        requests, errors = parse_file(path.name, data, max_line_bytes)
    except FileRejected as e:
        raise UsageError(f"{path}: {e.message}") from None
    return requests, [failure_of_line(path.name, 0, err) for err in errors]  # one run, one arrival: claim 0


def run_file(
    source: Path,
    output: Path,
    failed: Path,
    executor: Executor,
    on_progress: Callable[[int, int], None] | None = None,
) -> BatchReport:
    """Run every request of `source` and publish `output` (results, input order) and `failed` (failure
    records), each written to a temp name and renamed, so a crash leaves no half-written file."""
    t0 = time.perf_counter()
    for path in (output, failed):  # before any decoding, not after an hour of it
        if not path.parent.is_dir():
            raise UsageError(f"{path}: folder {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK):
            raise UsageError(f"{path}: folder {path.parent} is not writable")
    requests, failures = read_requests(source)
    total = len(requests) + len(failures)
    bodies: dict[int, dict[str, Any]] = {}
    done = 0
    for outcome in executor.run(requests):
        req = outcome.request
        if outcome.body is not None:
            bodies[req.line] = outcome.body
        else:
            code = outcome.code or "engine_error"
            failures.append(failure_of_request(source.name, 0, req, code, outcome.message or "", outcome.retryable))
        done += 1
        if on_progress is not None:
            on_progress(done, len(requests))
    if done != len(requests) or len(bodies) + len(failures) != total:  # an invariant, not a user error
        raise RuntimeError(f"executor returned {done} outcomes for {len(requests)} requests")
    lines = [result_line(source.name, req, bodies[req.line]) for req in requests if req.line in bodies]
    # the queue's records name a results file in its outputs folder; this run's results are at `output`
    failures = [{**rec, "output": str(output.resolve())} for rec in failures]
    failures.sort(key=lambda rec: rec["source"]["line"])
    try:
        atomic_write(failed, _jsonl(failures))
        atomic_write(output, _jsonl(lines))
    except OSError as e:
        raise CelerisError(f"cannot write the results: {e}") from None
    wall = time.perf_counter() - t0
    return BatchReport(total, len(lines), len(failures), round(wall, 3), str(output), str(failed))


def _jsonl(records: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
