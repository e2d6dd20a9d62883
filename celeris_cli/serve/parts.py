"""A batch reaches the queue a part at a time, so that a cancel can drop what is not decoding yet.

The queue reads a claimed file whole and decodes every line of it; it cannot be told to stop. So a batch's
input is cut into parts (consecutive lines, `2 * batch_size` requests each, more for a long file so that it
has at most `MAX_PARTS`), and only `OUTSTANDING` parts are in the queue at once: the next is published
when one is finished. A cancel takes the parts still in the inbox back out and publishes no more; the
parts the queue has claimed finish, and their answers are the batch's partial output.

A part is `<batch id>.<k>.jsonl` in the inbox, its lines the input's bytes unchanged, except that a JSON
line without `custom_id` (or `id`) is given `"custom_id": "line-N"`, N its line in the whole input: the
queue's own default would number it within the part (`line-N-auto` where another line names `line-N`).

A part's state, kept in the batch record: `new` (not published), `fed` (recorded, then published),
`seen` (the server saw the queue holding it past its inbox: never published again), `done` (answered),
`dropped` (cancelled before the queue claimed it), `quarantined` or `lost`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..spool.config import Folders

OUTSTANDING = 2
MAX_PARTS = 64
OPEN = ("new", "fed", "seen")  # the queue may still answer (or be given) these
QUEUED = ("fed", "seen")


def plan(batch_id: str, data: bytes, batch_size: int, max_file_requests: int) -> list[dict[str, Any]]:
    """The parts of an input: byte range, the number of lines before it (`offset`), its request lines."""
    total = sum(1 for raw in data.split(b"\n") if raw.strip())
    size = max(1, min(max(2 * batch_size, -(-total // MAX_PARTS)), max_file_requests))
    parts: list[dict[str, Any]] = []
    start = pos = seen = count = first = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end + 1
        count += 1 if data[pos:end].strip() else 0
        seen += 1
        pos = end
        if count == size:
            parts.append({"start": start, "end": pos, "offset": first, "lines": count})
            start, first, count = pos, seen, 0
    if count:
        parts.append({"start": start, "end": len(data), "offset": first, "lines": count})
    for k, part in enumerate(parts):
        part.update(name=f"{batch_id}.{k:04d}.jsonl", state="new")
    return parts


def read_line(raw: bytes) -> Any:
    """A line's JSON, or None when it is not JSON a reader can take (torn, not UTF-8, nested too deeply, or
    a number past Python's 4300-digit limit): such a line is the queue's to record, in the error file."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # ValueError: JSONDecodeError, UnicodeDecodeError, the digit limit
        return None


def with_custom_id(raw: bytes, line: int, renamed: dict[str, str] | None = None) -> bytes:
    """`raw` with a custom_id added when it is a JSON object without an id: `line-<line>`, or the name
    `renamed` gives the line (`batch_format.request_lines`)."""
    obj = read_line(raw)
    if not isinstance(obj, dict) or "custom_id" in obj or "id" in obj:
        return raw
    name = (renamed or {}).get(str(line), f"line-{line}")
    return json.dumps({"custom_id": name, **obj}).encode()


def _lines(data: bytes, part: dict[str, Any]) -> list[bytes]:
    chunk = data[part["start"] : part["end"]]
    lines = chunk.split(b"\n")
    if chunk.endswith(b"\n"):
        lines.pop()
    return lines


def part_bytes(data: bytes, part: dict[str, Any], renamed: dict[str, str] | None = None) -> bytes:
    """What is published to the inbox for `part` of the input `data`."""
    lines = _lines(data, part)
    off = part["offset"]
    out = [with_custom_id(raw, off + i, renamed) if raw.strip() else raw for i, raw in enumerate(lines, 1)]
    return b"\n".join(out) + b"\n"


def part_line_numbers(data: bytes, part: dict[str, Any]) -> list[int]:
    """The request lines of `part` (1-based, in the whole input)."""
    return [part["offset"] + i for i, raw in enumerate(_lines(data, part), 1) if raw.strip()]


def input_lines(data: bytes, numbers: list[int], renamed: dict[str, str] | None = None) -> bytes:
    """The lines `numbers` (1-based, in the whole input) of `data`, each with its custom_id, as a new input."""
    raw = data.split(b"\n")
    return b"".join(with_custom_id(raw[n - 1], n, renamed) + b"\n" for n in numbers if 0 < n <= len(raw))


def locate(f: Folders, name: str) -> tuple[str, str | None]:
    """Where the queue holds the file `name`, checked in the order it moves through the queue's folders
    (so a scan racing the daemon can only find it further along): pending, claimed (with its claim
    number), processed, quarantined or missing."""
    if (f.inputs / name).exists():
        return "pending", None
    if f.work.is_dir():
        for entry in os.scandir(f.work):
            claim, dot, rest = entry.name.partition(".")
            if dot and rest == name and claim.isdigit():
                return "claimed", claim
    if (f.processed / name).exists():
        return "processed", None
    if (f.quarantine / name).exists():
        return "quarantined", None
    return "missing", None


def results_of(f: Folders, name: str) -> Path:
    return f.outputs / f"{name}.results.jsonl"


def journal_of(f: Folders, claim: str) -> Path:
    return f.work / "journal" / f"{claim}.jsonl"
