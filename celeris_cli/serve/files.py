"""Uploaded and produced files (`/v1/files`), kept under the server's state folder.

`files/<id>.json` is a file's metadata and `files/<id>.data` its bytes, each written to a temp name,
fsynced and renamed (data first, so a metadata file always has its data), mode 0600 in a 0700 folder. Ids
are random and opaque; a request's id is only ever looked up in the index loaded from those files, never
joined to a path. A file belongs to the API key that uploaded it (`owner`, a hash of the key; None on a
server without keys): the routes show it to that key only.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from pathlib import Path
from typing import IO, Any

from ..spool.fsutil import fsync_dir
from .private import copy_private, private_folder, write_private

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
PURPOSES = ("batch", "batch_output")


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": meta["id"],
        "object": "file",
        "bytes": meta["bytes"],
        "created_at": meta["created_at"],
        "filename": meta["filename"],
        "purpose": meta["purpose"],
        "status": "processed",
    }


class FileStore:
    def __init__(self, folder: Path) -> None:
        self.folder = private_folder(folder)
        self.lock = threading.Lock()
        self.index: dict[str, dict[str, Any]] = {}
        for meta_path in folder.glob("file-*.json"):
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if FILE_ID.match(str(meta.get("id", ""))) and self._data(meta["id"]).is_file():
                self.index[meta["id"]] = meta
        for tmp in folder.glob(".*.tmp"):  # uploads cut short by a crash
            tmp.unlink(missing_ok=True)

    def _data(self, file_id: str) -> Path:
        assert FILE_ID.match(file_id), file_id  # ids are ours: made by new_file_id, checked by get
        return self.folder / f"{file_id}.data"

    def get(self, file_id: str) -> dict[str, Any] | None:
        return self.index.get(file_id) if FILE_ID.match(file_id) else None

    def path(self, file_id: str) -> Path:
        """The bytes of a file known to the index."""
        return self._data(self.index[file_id]["id"])

    def owned(self, file_id: str, owner: str | None) -> dict[str, Any] | None:
        """The file, if the key `owner` may see it."""
        meta = self.get(file_id)
        return meta if meta is not None and meta.get("owner") == owner else None

    def page(
        self, owner: str | None, after: str | None, limit: int, order: str = "desc", purpose: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """One page of the key's files, newest first unless `order` is `asc`, after the file `after`
        (an id not listed gives an empty page); and whether more follow."""
        with self.lock:  # uploads add to the index meanwhile
            metas = list(self.index.values())
        mine = [m for m in metas if m.get("owner") == owner and purpose in (None, m["purpose"])]
        ordered = sorted(mine, key=lambda m: (m["created_at"], m["id"]), reverse=order != "asc")
        if after is not None:
            ids = [m["id"] for m in ordered]
            ordered = ordered[ids.index(after) + 1 :] if after in ids else []
        return ordered[:limit], len(ordered) > limit

    def add_stream(
        self, source: IO[bytes], filename: str, purpose: str, file_id: str | None = None, owner: str | None = None
    ) -> dict[str, Any]:
        """Copy an upload in, durably; returns its metadata."""
        file_id = file_id or new_file_id()
        size = copy_private(self._data(file_id), source)
        return self._record(file_id, filename, purpose, size, owner)

    def add_bytes(
        self, content: bytes, filename: str, purpose: str, file_id: str | None = None, owner: str | None = None
    ) -> dict[str, Any]:
        file_id = file_id or new_file_id()
        write_private(self._data(file_id), content)
        return self._record(file_id, filename, purpose, len(content), owner)

    def _record(self, file_id: str, filename: str, purpose: str, size: int, owner: str | None) -> dict[str, Any]:
        meta = {
            "id": file_id,
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "owner": owner,
        }
        try:
            write_private(self.folder / f"{file_id}.json", json.dumps(meta).encode())
        except OSError:
            self._data(file_id).unlink(missing_ok=True)  # no data file without its metadata
            raise
        with self.lock:
            self.index[file_id] = meta
        return meta

    def delete(self, file_id: str) -> bool:
        with self.lock:
            meta = self.index.pop(file_id, None) if FILE_ID.match(file_id) else None
        if meta is None:
            return False
        (self.folder / f"{file_id}.json").unlink(missing_ok=True)  # the metadata first: no orphan is listed
        self._data(file_id).unlink(missing_ok=True)
        fsync_dir(self.folder)
        return True


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def derived_file_id(owner: str, role: str) -> str:
    """A stable id for a file the server makes (a batch's output): made again after a crash, it is the same."""
    import hashlib

    return "file-" + hashlib.sha256(f"{owner}:{role}".encode()).hexdigest()[:24]
