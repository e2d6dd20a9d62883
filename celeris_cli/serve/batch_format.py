"""The queue's files in OpenAI's batch format: its results become output lines, its failure records error
lines, its journal the counts of a batch in progress; and a batch's input is checked against its endpoint.

Output: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}` with a
`text_completion` or `chat.completion` body. Error: `{"id", "custom_id", "response": null, "error": {"code",
"message"}}`. Every id is derived from the batch id and the line, so lines made again are the same.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..spool.ledger import read_jsonl
from .schema import APIError, chat_completion, completion


def stable_id(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


def _line(batch_id: str, line: Any, custom_id: Any, response: Any, error: Any) -> dict[str, Any]:
    return {
        "id": f"batch_req_{stable_id(batch_id, line)}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def output_lines(batch_id: str, results: Path, chat: bool, model: str, created: int) -> list[dict[str, Any]]:
    """The queue's results file (its own shape: `{"id": "FILE:LINE", "custom_id", "response": {"body": {"text",
    "finish_reason", "usage", ...}}}`) as OpenAI output lines, in input order."""
    out = []
    build = chat_completion if chat else completion
    for rec in read_jsonl(results):
        line = str(rec.get("id", "")).rpartition(":")[2]
        body = rec["response"]["body"]
        obj = build(
            f"{'chatcmpl' if chat else 'cmpl'}-{stable_id(batch_id, line)}",
            model,
            body["text"],
            body["finish_reason"],
            body["usage"],
            created,
        )
        response = {"status_code": 200, "request_id": f"req_{stable_id(batch_id, line, 'r')}", "body": obj}
        out.append(_line(batch_id, line, rec["custom_id"], response, None))
    return out


def error_lines(batch_id: str, failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failure records as OpenAI error lines; a line without a custom_id says its line number."""
    out = []
    for r in failures:
        line = r["source"]["line"]
        message = r["message"] if r.get("custom_id") is not None else f"line {line}: {r['message']}"
        out.append(_line(batch_id, line, r.get("custom_id"), None, {"code": r["code"], "message": message}))
    return out


def failures_of(failed_log: Path, name: str) -> list[dict[str, Any]]:
    """The queue's failure records of the file `name`, once each (a record is keyed), by line."""
    seen: dict[Any, dict[str, Any]] = {}
    for rec in read_jsonl(failed_log):
        source = rec.get("source") or {}
        if source.get("file") == name and rec.get("output") == f"{name}.results.jsonl":
            seen.setdefault(rec.get("key"), rec)
    return sorted(seen.values(), key=lambda r: r["source"]["line"])


def journal_counts(path: Path) -> tuple[int, int]:
    """(results, failures) the queue's journal of a claim has decided so far."""
    done = failed = 0
    for rec in read_jsonl(path):
        for o in rec.get("outcomes", []):
            if "body" in o:
                done += 1
            else:
                failed += 1
    return done, failed


def request_lines(data: bytes, endpoint: str) -> int:
    """The number of request lines; a line that names another endpoint is a 400 (a line that is not a
    request at all is the queue's to record, in the error file)."""
    total = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        total += 1
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        url = obj.get("url") if isinstance(obj, dict) else None
        if url is not None and url != endpoint:
            raise APIError(
                400, f"line {number}: url {url!r} is not the batch's endpoint {endpoint}", param="input_file_id"
            )
    return total
