"""Operations over a queue besides serving it: `retry` and `status`.

`retry` never rewrites the failure log. It writes the chosen requests, with their attempt counted up,
as a new input file in the inbox (published atomically under a name derived from the records' keys), then
records those keys in `logs/retried.jsonl`. Running it twice resubmits nothing twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import QueueIOError, UsageError
from .config import BatchConfig
from .folders import HEARTBEAT, make_private, queue_lock
from .fsutil import append_line, atomic_write, waiting_lock
from .intake import is_candidate
from .ledger import now_iso, read_jsonl
from .status import read_heartbeat

# A request rejected for what its line says (parse, id, settings, length) fails the same way every time:
# retrying it needs the line fixed, so even --all leaves it alone unless forced.
USER_ERROR_CODES = frozenset(
    {"line_too_long", "invalid_utf8", "invalid_json", "invalid_id", "duplicate_id", "missing_prompt"}
    | {"bad_param", "prompt_too_long"}  # UsageError's codes (errors.py)
)


RETRY_LOCK = ".retry.lock"


@dataclass
class RetryReport:
    resubmitted: int = 0
    already_retried: int = 0
    already_done: int = 0
    not_retryable: int = 0
    user_errors: int = 0
    out_of_attempts: int = 0
    no_request: int = 0
    malformed: int = 0
    file: str | None = None  # the files written, as one string (also `files`)
    files: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # warnings, one per malformed line

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "details"}


def attempts(rec: dict[str, Any]) -> int | None:
    """How many times a record's request has run: the record's count, or the one its request carried in
    `_celeris` (a line-level error is recorded with attempt 1 whatever the line said). None if malformed."""
    counts = [rec.get("attempt", 1)]
    request = rec.get("request")
    if isinstance(request, dict) and isinstance(request.get("_celeris"), dict):
        counts.append(request["_celeris"].get("attempt", 1))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
        return None
    return max(counts)


def read_failure_log(log_path: Path, report: RetryReport) -> list[dict[str, Any]]:
    """The failure records of a log, with a line-numbered warning in `report.details` for each line that is
    not one. A file with lines but no failure record at all is not a failure log: UsageError."""
    records: list[dict[str, Any]] = []
    lines = 0
    with open(log_path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            lines += 1
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
                problem = "not a failure record (no key)"
            elif not isinstance(rec.get("retryable"), bool):
                problem = "not a failure record (no retryable flag)"
            elif attempts(rec) is None:
                problem = f"attempt must be a positive integer, got {rec.get('attempt')!r}"
            else:
                records.append(rec)
                continue
            report.malformed += 1
            report.details.append(f"{log_path}:{number}: skipped: {problem}")
    if lines and not records:
        raise UsageError(
            f"{log_path} is not a failure log: none of its {lines} lines is a failure record "
            "(the queue writes them to logs/failed.jsonl)"
        )
    return records


def plan_retry(cfg: BatchConfig, log_path: Path, include_all: bool, force: bool = False) -> RetryReport:
    """Choose failure records to run again and publish them as an inbox file. `include_all` adds records
    marked not retryable, except line-level user errors, which only `force` adds. Two retries at once
    take turns (a lock in logs/), so the second sees what the first resubmitted."""
    make_private(cfg)  # a retry writes in the queue as its daemon does
    cfg.folders.logs.mkdir(parents=True, exist_ok=True)
    cfg.folders.inputs.mkdir(parents=True, exist_ok=True)
    with waiting_lock(cfg.folders.logs / RETRY_LOCK):
        return _plan_retry(cfg, log_path, include_all, force)


def _plan_retry(cfg: BatchConfig, log_path: Path, include_all: bool, force: bool) -> RetryReport:
    ledger = cfg.folders.logs / "retried.jsonl"
    done = {rec.get("key") for rec in read_jsonl(ledger)}
    report = RetryReport()
    chosen: list[dict[str, Any]] = []
    seen: set[str] = set()
    results: dict[str, set[Any]] = {}

    def has_result(rec: dict[str, Any]) -> bool:
        """A later result for the same id, in the same results file, supersedes the failure record."""
        name = rec.get("output") or f"{(rec.get('source') or {}).get('file')}.results.jsonl"
        if not isinstance(name, str) or "/" in name:
            return False
        if name not in results:
            results[name] = {r.get("custom_id") for r in read_jsonl(cfg.folders.outputs / name)}
        return rec.get("custom_id") in results[name]

    for rec in read_failure_log(log_path, report):
        key = rec["key"]
        if key in seen:
            continue
        seen.add(key)
        request = rec.get("request")
        if key in done:
            report.already_retried += 1
        elif rec.get("custom_id") is not None and has_result(rec):
            report.already_done += 1
        elif rec.get("code") in USER_ERROR_CODES and not force:
            report.user_errors += 1
        elif not rec["retryable"] and not (include_all or force):
            report.not_retryable += 1
        elif not isinstance(request, dict) or not (request.get("prompt") or request.get("messages")):
            report.no_request += 1
        elif (attempts(rec) or 1) >= cfg.max_attempts:
            report.out_of_attempts += 1
        else:
            chosen.append(rec)
    if not chosen:
        return report
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in chosen:  # one retry file per source file: ids are unique within a file, not across files
        source = rec.get("source")
        groups.setdefault(str(source.get("file") if isinstance(source, dict) else None), []).append(rec)
    entries = []
    try:
        for group in groups.values():
            digest = hashlib.sha256("\n".join(sorted(r["key"] for r in group)).encode()).hexdigest()[:12]
            name = f"retry-{digest}.jsonl"
            lines = []
            for rec in group:
                body = dict(rec["request"])
                origin = rec.get("origin") or rec.get("source")
                body["_celeris"] = {"attempt": (attempts(rec) or 1) + 1, "origin": origin}
                lines.append(json.dumps(body, ensure_ascii=False))
            atomic_write(cfg.folders.inputs / name, ("\n".join(lines) + "\n").encode())
            report.files.append(name)
            entries += [json.dumps({"key": rec["key"], "file": name, "time": now_iso()}) for rec in group]
        append_line(ledger, "\n".join(entries))  # one append, one fsync: all of them or none
    except OSError as e:
        for name in report.files:  # not recorded as retried: take back what a daemon has not claimed yet
            (cfg.folders.inputs / name).unlink(missing_ok=True)
        where = e.filename or ledger
        raise QueueIOError(f"retry: cannot write {where}: {e.strerror or e}; nothing was recorded as retried") from None
    report.resubmitted = len(chosen)
    report.file = ", ".join(report.files)
    return report


def status(cfg: BatchConfig) -> dict[str, Any]:
    f = cfg.folders
    now = time.time()

    def entries(folder: Path) -> list[os.DirEntry[str]]:
        if not folder.is_dir():
            return []
        return [e for e in os.scandir(folder) if is_candidate(e.name) and not e.is_dir(follow_symlinks=False)]

    pending = entries(f.inputs)
    oldest = min((e.stat(follow_symlinks=False).st_mtime for e in pending), default=None)
    holder = queue_lock(cfg).holder()
    heartbeat = read_heartbeat(f.logs / HEARTBEAT, holder)
    failures = sum(1 for _ in read_jsonl(f.logs / "failed.jsonl"))
    return {
        "root": str(cfg.root),
        "counts": {
            "pending": len(pending),
            "in_progress": len(entries(f.work)) if f.work.is_dir() else 0,
            "outputs": sum(1 for e in entries(f.outputs) if e.name.endswith(".results.jsonl")),
            "processed": len(entries(f.processed)),
            "quarantined": len(entries(f.quarantine)),
            "failure_records": failures,
        },
        "oldest_pending_age_s": round(now - oldest, 1) if oldest is not None else None,
        "lock_holder": holder,
        "heartbeat": heartbeat,
    }
