"""Poison: a request that was in flight each time the daemon died or was stopped.

When a claim is resumed, its journal says which lines were in flight in earlier claims. A line in flight
`max_claims` times gets a `poison` failure record, decided for good, and the rest of the file is served.
A file that was claimed `2 * max_claims` times in a row without deciding anything, with no line to blame
(a death outside decoding), has all its remaining requests recorded as poison.
"""

from __future__ import annotations

from typing import Any

from .intake import Job
from .journal import try_counts
from .ledger import EventLog
from .publish import request_failure


def resume(job: Job, max_claims: int, events: EventLog) -> None:
    """Load what earlier claims decided into `job`, and decide the poison lines."""
    state = job.journal.resume()
    job.outcomes = state.outcomes
    job.suspects = state.suspects
    counts = try_counts(state)
    poisoned: dict[int, dict[str, Any]] = {}
    for req in job.requests:
        if req.line not in job.outcomes and counts.get(req.line, 0) >= max_claims:
            message = f"in flight each of the {counts[req.line]} times the daemon died or was stopped"
            poisoned[req.line] = {"line": req.line, "failure": request_failure(job, req, "poison", message, False)}
    if state.idle_claims >= 2 * max_claims:
        message = f"the file was claimed {state.idle_claims} times in a row without deciding any request"
        for req in job.requests:
            if req.line not in job.outcomes and req.line not in poisoned:
                poisoned[req.line] = {"line": req.line, "failure": request_failure(job, req, "poison", message, False)}
    if poisoned:
        job.journal.append({"outcomes": list(poisoned.values())})
        job.outcomes.update(poisoned)
        events("poison", file=job.name, claim=job.seq, lines=sorted(poisoned))
