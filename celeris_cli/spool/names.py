"""Names the queue derives from a user's file name: results, claims, processed copies, `~N` renames.

Any name the filesystem allows may arrive (a newline, bytes that are not UTF-8, 255 bytes). Every name
derived from it must fit `NAME_MAX` too: the longest is `.<name>.results.jsonl.tmp`, so a job's name is
kept to `MAX_JOB_NAME` bytes, shortened where needed to a readable stem, a hash of the whole name and
the original suffix (the suffix says how the file is parsed). A derived name is only ever chosen when no
file of that name exists anywhere a user or the queue may have put one (see `Inbox.claim`).
"""

from __future__ import annotations

import hashlib
import os

NAME_MAX = 255  # bytes, Linux and macOS
# `.`+name+`.results.jsonl.tmp` is 19 bytes more; `<claim:08d>.`+name 9 (10 past 10^8 claims);
# `name~<claim>` for a processed copy placed beside another up to 11
MAX_JOB_NAME = NAME_MAX - 24
HASH_CHARS = 10


def name_bytes(name: str) -> int:
    return len(os.fsencode(name))


def split_suffix(name: str) -> tuple[str, str]:
    """(`stem`, `.suffix`), or (`name`, ``) when it has none or a suffix too long to be one."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or not stem or name_bytes(suffix) > 16:
        return name, ""
    return stem, "." + suffix


def fit(name: str, limit: int = MAX_JOB_NAME) -> str:
    """`name` itself if it fits `limit` bytes, else `<readable stem>~<hash><suffix>` that does."""
    if name_bytes(name) <= limit:
        return name
    stem, suffix = split_suffix(name)
    tag = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:HASH_CHARS]
    room = limit - name_bytes(tag + suffix)
    kept = ""
    for ch in stem:  # whole characters only, so a UTF-8 sequence is never cut
        if name_bytes(kept + ch) > room:
            break
        kept += ch
    return kept + tag + suffix


def renamed(name: str, claim: int, attempt: int = 0) -> str:
    """The name of a second file called `name`: `<stem>~<claim><suffix>` (then `~<claim>.<attempt>`)."""
    stem, suffix = split_suffix(name)
    tag = f"~{claim}" + (f".{attempt}" if attempt else "")
    return fit(stem + tag + suffix) if name_bytes(stem + tag + suffix) > MAX_JOB_NAME else stem + tag + suffix
