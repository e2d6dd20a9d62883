"""Publish: a claimed file's results, then its failure records, then its input to `processed/`, each step
durable before the next; or, for a file that cannot be read at all, its input to quarantine.

Results first: a crash after the publish and before the failure records is redone from the journal with
the same outcomes, so each id has one result or one failure record, never both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import fsutil
from .config import Folders
from .formats import LineError, Request, result_line
from .fsutil import crashpoint, fsync_dir, rename_noreplace
from .intake import Job
from .ledger import EventLog, FailureLog, dumps, failure_of_file, failure_of_line, failure_of_request


class Publisher:
    def __init__(self, folders: Folders, output_formats: tuple[str, ...], failures: FailureLog, events: EventLog):
        self.f = folders
        self.output_formats = output_formats
        self.failures = failures
        self.events = events

    def stage(self, job: Job) -> list[tuple[Path, Path]]:
        """Write the results files under temp names: (temp, final) pairs. Raises OSError (full disk,
        read-only folder) with no temp file left."""
        lines = []
        text = []
        for req in job.requests:
            body = job.outcomes.get(req.line, {}).get("body")
            if body is not None:
                lines.append(result_line(job.name, req, body))
                text.append(f"[{req.custom_id}]\n{body['text']}\n\n")
        files = {f"{job.name}.results.jsonl": "".join(dumps(x) + "\n" for x in lines).encode()}
        if "txt" in self.output_formats:
            files[f"{job.name}.results.txt"] = "".join(text).encode("utf-8", "replace")
        staged: list[tuple[Path, Path]] = []
        try:
            for name, data in files.items():
                staged.append((fsutil.stage(self.f.outputs / name, data), self.f.outputs / name))
        except OSError:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            raise
        return staged

    def records(self, job: Job) -> tuple[int, int]:
        """Append the failure records (already-recorded keys are skipped). Returns (failures, new records)."""
        recs = job.failures + [o["failure"] for o in job.outcomes.values() if "failure" in o]
        recorded = sum(self.failures.append(rec) for rec in recs)
        crashpoint("after_failure_append")
        return len(recs), recorded

    def processed(self, job: Job) -> Path:
        """Move the input to processed/ (the caller fsyncs both folders once for a group of files)."""
        return _place(job, self.f.processed, sync=False)

    def quarantine(self, job: Job, code: str, message: str) -> dict[str, Any]:
        """Record the file's failure, then move it to quarantine. Raises OSError when either is refused
        (a full disk, a folder deleted under it); done again, it records nothing twice."""
        rec = failure_of_file(job.name, job.seq, code, message)
        self.failures.append(rec)
        _place(job, self.f.quarantine)
        try:
            fsync_dir(job.path.parent)
        except FileNotFoundError:
            pass  # the work folder deleted under us: nothing of ours left to make durable there
        job.journal.remove()
        self.events("quarantined", file=job.name, claim=job.seq, code=code)
        return rec


def _place(job: Job, folder: Path, sync: bool = True) -> Path:
    """Move the claimed file to `folder/name`, or `name~claim` if a file of that name got there meanwhile:
    never over another file."""
    for dst in (folder / job.name, folder / f"{job.name}~{job.seq}"):
        if rename_noreplace(job.path, dst):
            if sync:
                fsync_dir(folder)
            return dst
    raise FileExistsError(f"{folder}: both {job.name} and {job.name}~{job.seq} exist")


def line_failure(job: Job, err: LineError) -> dict[str, Any]:
    return failure_of_line(job.name, job.seq, err)


def request_failure(job: Job, req: Request, code: str, message: str, retryable: bool) -> dict[str, Any]:
    return failure_of_request(job.name, job.seq, req, code, message, retryable)
