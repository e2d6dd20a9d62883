"""Publish: a claimed file's results, then its input to `processed/`, each step durable before the next;
or, for a file that cannot be read at all, its input to quarantine with one failure record."""

from __future__ import annotations

import json
from typing import Any

from .config import Folders
from .formats import LineError, Request
from .fsutil import atomic_write, crashpoint, move
from .intake import Job
from .ledger import EventLog, FailureLog, failure_record


class Publisher:
    def __init__(self, folders: Folders, output_formats: tuple[str, ...], failures: FailureLog, events: EventLog):
        self.f = folders
        self.output_formats = output_formats
        self.failures = failures
        self.events = events

    def finish(self, job: Job) -> tuple[int, int]:
        """Failures, then outputs, then the move to processed. Returns (results, failures)."""
        recorded = 0
        for rec in job.failures:
            recorded += self.failures.append(rec)
        crashpoint("after_failure_append")
        lines = []
        for req in job.requests:
            body = job.bodies.get(req.custom_id)
            if body is not None:
                lines.append(
                    {
                        "id": f"{job.name}:{req.line}",
                        "custom_id": req.custom_id,
                        "response": {"status_code": 200, "body": body},
                        "error": None,
                    }
                )
        out = self.f.outputs / f"{job.name}.results.jsonl"
        atomic_write(
            out,
            "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode(),
            crash_name="after_output_tmp",
        )
        if "txt" in self.output_formats:
            text = "".join(
                f"[{req.custom_id}]\n{job.bodies[req.custom_id]['text']}\n\n"
                for req in job.requests
                if req.custom_id in job.bodies
            )
            atomic_write(self.f.outputs / f"{job.name}.results.txt", text.encode())
        crashpoint("after_publish")
        move(job.path, self.f.processed / job.name)
        crashpoint("after_move")
        self.events(
            "published", file=job.name, results=len(lines), failures=len(job.failures), new_failure_records=recorded
        )
        return len(lines), len(job.failures)

    def quarantine(self, job: Job, code: str, message: str) -> None:
        rec = failure_record(
            source=job.name,
            line=0,
            code=code,
            message=message,
            retryable=False,
            attempt=1,
            request=None,
            custom_id=None,
        )
        self.failures.append(rec)
        move(job.path, self.f.quarantine / job.name)
        self.events("quarantined", file=job.name, code=code)


def line_failure(job: Job, err: LineError) -> dict[str, Any]:
    return failure_record(
        source=job.name,
        line=err.line,
        code=err.code,
        message=err.message,
        retryable=err.retryable,
        attempt=err.attempt,
        request=err.request,
        custom_id=err.custom_id,
    )


def request_failure(job: Job, req: Request, code: str, message: str, retryable: bool) -> dict[str, Any]:
    return failure_record(
        source=job.name,
        line=req.line,
        code=code,
        message=message,
        retryable=retryable,
        attempt=req.attempt,
        request=req.body(),
        custom_id=req.custom_id,
        origin=req.origin,
    )
