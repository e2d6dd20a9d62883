"""A batch's record on disk (`batches/<id>.json`), read back at startup: checked field by field, so that a
record this server cannot read (torn, edited, or written by an older server that stored metadata it should
have refused) is reported as such, a `failed` batch whose error says why, and never takes a listing down.
Such a record is left on disk as it is.

Metadata is checked as OpenAI checks it, before anything is stored: at most 16 pairs, keys of at most 64
characters and values of at most 512, strings, and text (no lone surrogate from a JSON escape).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")
PART_STATES = ("new", "fed", "seen", "done", "dropped", "quarantined", "lost")
MAX_PAIRS, MAX_KEY_CHARS, MAX_VALUE_CHARS = 16, 64, 512


def _text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def metadata_problem(metadata: Any) -> str | None:
    """What is wrong with a batch's `metadata` in the user's terms, or None."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return "give an object of string keys and string values"
    if len(metadata) > MAX_PAIRS:
        return f"at most {MAX_PAIRS} key-value pairs, got {len(metadata)}"
    for key, value in metadata.items():
        shown = str(key).encode("utf-8", "backslashreplace").decode()[:80]
        if not isinstance(key, str) or not _text(key):
            return f"the key {shown!r} is not text (a lone surrogate)"
        if len(key) > MAX_KEY_CHARS:
            return f"the key {shown!r} has {len(key)} characters; a key has at most {MAX_KEY_CHARS}"
        if not isinstance(value, str):
            return f"the value of {shown!r} must be a string, got {type(value).__name__}"
        if not _text(value):
            return f"the value of {shown!r} is not text (a lone surrogate)"
        if len(value) > MAX_VALUE_CHARS:
            return f"the value of {shown!r} has {len(value)} characters; a value has at most {MAX_VALUE_CHARS}"
    return None


def _problem(meta: dict[str, Any], stem: str) -> str | None:
    """What makes a parsed record unusable, or None."""
    if meta.get("id") != stem:
        return f"its id {str(meta.get('id'))[:40]!r} is not its file's name"
    kinds: dict[str, Any] = {
        "endpoint": lambda v: v in ENDPOINTS,
        "status": lambda v: v in STATUSES,
        "input_file_id": lambda v: isinstance(v, str),
        "completion_window": lambda v: isinstance(v, str),
        "created_at": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "total": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "owner": lambda v: v is None or isinstance(v, str),
    }
    for key, ok in kinds.items():
        if key not in meta or not ok(meta[key]):
            return f"its {key} is missing or not valid"
    if (wrong := metadata_problem(meta.get("metadata"))) is not None:
        return f"its metadata: {wrong}"
    parts = meta.get("parts")
    if not isinstance(parts, list) or not all(
        isinstance(p, dict)
        and isinstance(p.get("name"), str)
        and p.get("state") in PART_STATES
        and all(isinstance(p.get(k), int) for k in ("start", "offset"))
        and (p.get("end") is None or isinstance(p.get("end"), int))
        for p in parts
    ):
        return "its parts are missing or not valid"
    try:
        json.dumps(meta, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError, TypeError):
        return "it holds text that is not valid Unicode"
    return None


def unreadable(path: Path, why: str, meta: Any) -> dict[str, Any]:
    """The record of a batch this server cannot read, as a `failed` batch whose error says why (its owner,
    when the record still names one; otherwise visible only on a server without keys)."""
    meta = meta if isinstance(meta, dict) else {}
    owner = meta.get("owner") if isinstance(meta.get("owner"), str) else None
    created = meta.get("created_at")
    if not isinstance(created, int) or isinstance(created, bool):
        try:
            created = int(path.stat().st_mtime)
        except OSError:
            created = 0
    message = f"the server cannot read this batch's record ({why}); the file {path.name} is left as it is"
    return {
        "id": path.stem,
        "endpoint": meta.get("endpoint") if meta.get("endpoint") in ENDPOINTS else ENDPOINTS[0],
        "input_file_id": meta.get("input_file_id") if isinstance(meta.get("input_file_id"), str) else "",
        "completion_window": "24h",
        "status": "failed",
        "created_at": created,
        "failed_at": created,
        "total": 0,
        "owner": owner,
        "parts": [],
        "unreadable": why,
        "errors": {
            "object": "list",
            "data": [{"code": "unreadable_record", "message": message, "param": None, "line": None}],
        },
    }


def read_record(path: Path) -> tuple[dict[str, Any], str | None]:
    """(the record, None) or (its `unreadable` stand-in, the reason); a record from before parts is given
    the one part its input was."""
    try:
        text = path.read_text(encoding="utf-8")
        meta = json.loads(text)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON, the digit limit
        why = "not valid JSON" if isinstance(e, ValueError) else type(e).__name__
        return unreadable(path, why, None), why
    if not isinstance(meta, dict):
        return unreadable(path, "not a JSON object", None), "not a JSON object"
    if "parts" not in meta and "name" in meta and "status" in meta:  # a record from before parts
        state = "fed" if meta["status"] == "validating" else "seen"
        meta["parts"] = [{"name": meta["name"], "start": 0, "end": None, "offset": 0, "state": state}]
    problem = _problem(meta, path.stem)
    return (unreadable(path, problem, meta), problem) if problem else (meta, None)
