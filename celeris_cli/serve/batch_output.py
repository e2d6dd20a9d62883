"""A finished batch's answers: its parts' results and failure records, in input order, as OpenAI output
and error lines."""

from __future__ import annotations

from typing import Any

from ..spool.config import Folders
from .batch_format import error_lines, failures_of, output_lines
from .parts import results_of

Lines = list[dict[str, Any]]


def assemble(meta: dict[str, Any], f: Folders, model: str) -> tuple[Lines, Lines, Lines, list[int]]:
    """(output lines, error lines, batch-level errors, the input line numbers that failed) of the parts
    answered (`done`); a part the queue quarantined or lost is a batch-level error."""
    chat = meta["endpoint"] == "/v1/chat/completions"
    out: Lines = []
    errors: Lines = []
    problems: Lines = []
    failed: list[int] = []
    for part in meta["parts"]:
        name, offset = part["name"], part["offset"]
        if part["state"] == "done":
            out += output_lines(meta["id"], results_of(f, name), chat, model, meta["finalizing_at"], offset)
            recs = failures_of(f.logs / "failed.jsonl", name)
            errors += error_lines(meta["id"], recs, offset)
            failed += [offset + int(r["source"]["line"]) for r in recs if r["source"].get("line")]
        elif part["state"] == "quarantined":
            problems += part.get("errors") or [{"code": "quarantined", "message": f"the queue refused {name}"}]
        elif part["state"] == "lost":
            problems.append({"code": "lost", "message": f"the queue no longer holds {name}"})
    return out, errors, problems, sorted(failed)
