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

from .config import BatchConfig
from .daemon import HEARTBEAT, LOCK_NAME
from .fsutil import QueueLock, append_line, atomic_write
from .intake import is_candidate
from .ledger import now_iso, read_jsonl


@dataclass
class RetryReport:
    resubmitted: int = 0
    already_retried: int = 0
    not_retryable: int = 0
    out_of_attempts: int = 0
    no_request: int = 0
    file: str | None = None
    details: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "details"}


def plan_retry(cfg: BatchConfig, log_path: Path, include_all: bool) -> RetryReport:
    """Choose failure records to run again and publish them as an inbox file."""
    ledger = cfg.folders.logs / "retried.jsonl"
    done = {rec.get("key") for rec in read_jsonl(ledger)}
    report = RetryReport()
    chosen: list[dict[str, Any]] = []
    seen: set[str] = set()
    for rec in read_jsonl(log_path):
        key = rec.get("key")
        if not isinstance(key, str) or key in seen:
            continue
        seen.add(key)
        request = rec.get("request")
        if key in done:
            report.already_retried += 1
        elif not rec.get("retryable") and not include_all:
            report.not_retryable += 1
        elif not isinstance(request, dict) or not (request.get("prompt") or request.get("messages")):
            report.no_request += 1
        elif int(rec.get("attempt", 1)) >= cfg.max_attempts:
            report.out_of_attempts += 1
        else:
            chosen.append(rec)
    if not chosen:
        return report
    digest = hashlib.sha256("\n".join(sorted(r["key"] for r in chosen)).encode()).hexdigest()[:12]
    name = f"retry-{digest}.jsonl"
    lines = []
    for rec in chosen:
        body = dict(rec["request"])
        body["_celeris"] = {"attempt": int(rec.get("attempt", 1)) + 1, "origin": rec.get("origin") or rec.get("source")}
        lines.append(json.dumps(body, ensure_ascii=False))
    atomic_write(cfg.folders.inputs / name, ("\n".join(lines) + "\n").encode())
    for rec in chosen:
        append_line(ledger, json.dumps({"key": rec["key"], "file": name, "time": now_iso()}))
    report.resubmitted = len(chosen)
    report.file = name
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
    heartbeat = None
    hb = f.logs / HEARTBEAT
    if hb.is_file():
        try:
            heartbeat = json.loads(hb.read_text(encoding="utf-8"))
            heartbeat["age_s"] = round(now - heartbeat.get("unix", now), 1)
        except (json.JSONDecodeError, OSError):
            heartbeat = None
    failures = sum(1 for _ in read_jsonl(f.logs / "failed.jsonl"))
    return {
        "root": str(cfg.root),
        "counts": {
            "pending": len(pending),
            "in_progress": len(entries(f.work)),
            "outputs": sum(1 for e in entries(f.outputs) if e.name.endswith(".results.jsonl")),
            "processed": len(entries(f.processed)),
            "quarantined": len(entries(f.quarantine)),
            "failure_records": failures,
        },
        "oldest_pending_age_s": round(now - oldest, 1) if oldest is not None else None,
        "lock_holder": QueueLock(cfg.root / LOCK_NAME).holder(),
        "heartbeat": heartbeat,
    }
