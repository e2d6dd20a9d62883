"""The queue's files in OpenAI's batch format: its results become output lines, its failure records error
lines, its journal the counts of a batch in progress; and a batch's input is checked against its endpoint.

Output: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}` with a
`text_completion` or `chat.completion` body. Error: `{"id", "custom_id", "response": null, "error": {"code",
"message"}}`. Every id is derived from the batch id and the line, so lines made again are the same.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ..spool.ledger import read_jsonl
from .parts import read_line
from .schema import APIError, Choice, chat_completion, completion


def stable_id(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


def _line(batch_id: str, line: Any, custom_id: Any, response: Any, error: Any) -> dict[str, Any]:
    return {
        "id": f"batch_req_{stable_id(batch_id, line)}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def output_lines(
    batch_id: str, results: Path, chat: bool, model: str, created: int, offset: int = 0
) -> list[dict[str, Any]]:
    """The queue's results file of a part (its own shape: `{"id": "FILE:LINE", "custom_id", "response":
    {"body": {"text", "finish_reason", "usage", ...}}}`) as OpenAI output lines, in input order; `offset`
    is the number of input lines before the part."""
    out = []
    for rec in read_jsonl(results):
        local = str(rec.get("id", "")).rpartition(":")[2]
        line = offset + int(local) if local.isdigit() else local
        body = rec["response"]["body"]
        entries = (body.get("logprobs") or {}).get("content")  # the queue's body: OpenAI chat's shape
        choice = Choice(body["text"], body["finish_reason"], entries, body.get("error"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{stable_id(batch_id, line)}"
        obj = (
            chat_completion(rid, model, choice, body["usage"], created)
            if chat
            else completion(rid, model, [choice], body["usage"], created)
        )
        response = {"status_code": 200, "request_id": f"req_{stable_id(batch_id, line, 'r')}", "body": obj}
        out.append(_line(batch_id, line, rec["custom_id"], response, None))
    return out


def error_lines(batch_id: str, failures: list[dict[str, Any]], offset: int = 0) -> list[dict[str, Any]]:
    """Failure records of a part as OpenAI error lines; a line the queue could not read an id from (not
    JSON, say) is `line-N`, as the queue names a line without one, and its message says the line."""
    out = []
    for r in failures:
        line = offset + int(r["source"]["line"])
        custom_id = r.get("custom_id")
        message = r["message"] if custom_id is not None else f"line {line}: {r['message']}"
        error = {"code": r["code"], "message": message}
        out.append(_line(batch_id, line, custom_id if custom_id is not None else f"line-{line}", None, error))
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
    """(results, failures) the queue's journal of a claim has decided so far, counted by line: the queue
    writes a line's outcome again each time a blocked publish is retried (`spool/finish.py`,
    `blocked_or_raise`), and on a clean stop, so a line is counted once, as its last outcome says."""
    decided: dict[int, bool] = {}
    for rec in read_jsonl(path):
        for o in rec.get("outcomes", []):
            if isinstance(o, dict) and isinstance(o.get("line"), int):
                decided[o["line"]] = "body" in o
    done = sum(decided.values())
    return done, len(decided) - done


def request_lines(data: bytes, endpoint: str) -> tuple[int, dict[str, str]]:
    """(the number of request lines, the ids of lines without one that the queue's `line-N` would confuse
    with an id the file gives). A line that names another endpoint, or repeats a custom_id, is a 400 (a line
    that is not a request at all is the queue's to record, in the error file). The queue finds a repeated id
    only within one file, and a batch reaches it in parts (`parts.py`), so it is found here.

    A line without an id is `line-N` (N its line), unless another line names that id: then it is
    `line-N-auto` (or `-auto2`, ...), so that an id the user never wrote is never a duplicate."""
    total = 0
    ids: set[str] = set()
    unnamed: list[int] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        total += 1
        obj = read_line(raw)
        if not isinstance(obj, dict):
            continue
        url = obj.get("url")
        if url is not None and url != endpoint:
            raise APIError(
                400, f"line {number}: url {url!r} is not the batch's endpoint {endpoint}", param="input_file_id"
            )
        if "custom_id" not in obj and "id" not in obj:
            unnamed.append(number)
            continue
        custom_id = str(obj.get("custom_id", obj.get("id")))
        if custom_id in ids:
            raise APIError(
                400,
                f"line {number}: custom_id {custom_id[:80]!r} appears earlier in the file",
                param="input_file_id",
            )
        ids.add(custom_id)
    renamed: dict[str, str] = {}
    for number in unnamed:
        name, k = f"line-{number}", 1
        while name in ids:
            name, k = f"line-{number}-auto{k if k > 1 else ''}", k + 1
        if name != f"line-{number}":
            renamed[str(number)] = name
            ids.add(name)
    return total, renamed
