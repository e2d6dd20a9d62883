"""Append-only JSONL logs: `failed.jsonl` (one self-contained record per failed request), the retry
ledger and the event log. Readers tolerate a torn last line (a crash mid-append)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .formats import LineError, Request
from .fsutil import append_line

log = logging.getLogger(__name__)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL log; unparsable lines (a torn write) are skipped with a warning."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                log.warning("%s:%d: skipping a torn or corrupt line", path, number)
                continue
            if isinstance(rec, dict):
                yield rec


def dumps(record: Any) -> str:
    """One JSON line, readable UTF-8; text that is not valid Unicode (a lone surrogate from a JSON escape)
    is written as an escape instead, so a log line can always be encoded."""
    text = json.dumps(record, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(record, ensure_ascii=True)
    return text


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FailureLog:
    """`logs/failed.jsonl`. Each record has a stable `key` (claim, file, line, attempt), so a file that is
    processed again after a crash does not record the same failure twice, and a later arrival of the same
    name (a new claim) can never collide with an earlier one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.keys: set[Any] = set()
        self.max_claim = 0  # claim numbers continue past every one on record
        for rec in read_jsonl(path):
            self.keys.add(rec.get("key"))
            claim = rec.get("claim")
            if isinstance(claim, int) and claim > self.max_claim:
                self.max_claim = claim

    def append(self, record: dict[str, Any]) -> bool:
        if record["key"] in self.keys:
            return False
        append_line(self.path, dumps(record), crash_name="mid_failure_append")
        self.keys.add(record["key"])
        return True


def failure_record(
    *,
    source: str,
    line: int,
    code: str,
    message: str,
    retryable: bool,
    attempt: int,
    request: Any,
    custom_id: str | None,
    claim: int,
    origin: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "key": f"{claim}/{source}:{line}:{attempt}",
        "claim": claim,
        "output": f"{source}.results.jsonl",
        "time": now_iso(),
        "custom_id": custom_id,
        "source": {"file": source, "line": line},
        "origin": origin or {"file": source, "line": line},
        "code": code,
        "message": message,
        "retryable": retryable,
        "attempt": attempt,
        "request": request,
    }


def failure_of_file(source: str, claim: int, code: str, message: str) -> dict[str, Any]:
    """The record of a whole file (quarantined, or changed after its claim): line 0, no request."""
    return failure_record(
        source=source,
        line=0,
        code=code,
        message=message,
        retryable=False,
        attempt=1,
        request=None,
        custom_id=None,
        claim=claim,
    )


def failure_of_changed_line(source: str, claim: int, line: int, code: str) -> dict[str, Any]:
    """The record of a line that changed after it was read: its number in `source.line`, and a key of its
    own (`:changed`), apart from that line's request record and from the file's record (line 0)."""
    rec = failure_record(
        source=source,
        line=line,
        code=code,
        message=f"line {line} changed after it was read",
        retryable=False,
        attempt=1,
        request=None,
        custom_id=None,
        claim=claim,
    )
    return {**rec, "key": rec["key"] + ":changed"}


def failure_of_line(source: str, claim: int, err: LineError) -> dict[str, Any]:
    """The record of a line that is not a request."""
    return failure_record(
        source=source,
        line=err.line,
        code=err.code,
        message=err.message,
        retryable=err.retryable,
        attempt=err.attempt,
        request=err.request,
        custom_id=err.custom_id,
        claim=claim,
    )


def failure_of_request(
    source: str, claim: int, req: Request, code: str, message: str, retryable: bool
) -> dict[str, Any]:
    """The record of a request that did not produce a result: self-contained, so retry needs nothing else."""
    return failure_record(
        source=source,
        line=req.line,
        code=code,
        message=message,
        retryable=retryable,
        attempt=req.attempt,
        request=req.body(),
        custom_id=req.custom_id,
        origin=req.origin,
        claim=claim,
    )


class EventLog:
    """`logs/events.jsonl`: what the daemon did, one JSON object per event. Prompts never appear here.
    Diagnostics, not state: appended without fsync (the queue's truth is in its folders and journals)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, event: str, **fields: Any) -> None:
        try:
            append_line(self.path, dumps({"time": now_iso(), "event": event, **fields}), durable=False)
        except OSError as e:  # the event log is diagnostics; it must never stop the queue
            log.warning("cannot write %s: %s", self.path, e)
