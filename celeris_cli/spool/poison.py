"""Poison: a request that kills the process each time it is decoded alone.

When a claim is resumed, its journal says what ended each earlier claim (`journal`). A stop (SIGTERM,
SIGINT, a grace that ran out) or a machine restart is never evidence against a request; a death is
evidence only against a suspect that was being tested alone when it came (after a first death, the
requests that were in flight are suspects, tested together; a test that dies is halved, down to one
request). A request with `max_claims` such deaths gets a `poison` failure record, decided for good, and
the rest of the file is served. So the daemon killed while ordinary batches decode costs one batch decoded
again, and a request that really kills the process is found after about `log2(rows in flight) +
max_claims + 1` deaths. A file whose resumed claims died `2 * max_claims` times in
a row while its requests were read or prepared (a death outside decoding) has all its remaining requests
recorded as poison; a claim that was only waiting for its turn when the process died counts for nothing.
"""

from __future__ import annotations

from typing import Any

from .intake import Job
from .ledger import EventLog
from .publish import request_failure


def resume(job: Job, max_claims: int, events: EventLog) -> None:
    """Load what earlier claims decided into `job`, and decide the poison lines."""
    state = job.journal.resume()
    job.outcomes = state.outcomes
    job.suspects = state.suspects
    job.groups = state.groups
    poisoned: dict[int, dict[str, Any]] = {}
    for req in job.requests:
        deaths = state.evidence.get(req.line, 0)
        if req.line not in job.outcomes and deaths >= max_claims:
            message = f"the process died each of the {deaths} times this request was decoded alone"
            poisoned[req.line] = {"line": req.line, "failure": request_failure(job, req, "poison", message, False)}
    if state.idle_deaths >= 2 * max_claims:
        message = f"the process died {state.idle_deaths} times in a row before any request of the file was decoded"
        for req in job.requests:
            if req.line not in job.outcomes and req.line not in poisoned:
                poisoned[req.line] = {"line": req.line, "failure": request_failure(job, req, "poison", message, False)}
    if poisoned:
        job.journal.append({"outcomes": list(poisoned.values())})
        job.outcomes.update(poisoned)
        events("poison", file=job.name, claim=job.seq, lines=sorted(poisoned))
    if job.suspects:
        events("suspects", file=job.name, claim=job.seq, lines=sorted(job.suspects))
