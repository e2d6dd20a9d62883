"""Uploaded and produced files (`/v1/files`), kept under the server's state folder.

`files/<id>.json` is a file's metadata and `files/<id>.data` its bytes, each written to a temp name,
fsynced and renamed (data first, so a metadata file always has its data). Ids are random and opaque; a
request's id is only ever looked up in the index loaded from those files, never joined to a path.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import IO, Any

from ..spool.fsutil import atomic_write, fsync_dir

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
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
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

    def listing(self) -> list[dict[str, Any]]:
        return sorted(self.index.values(), key=lambda m: (m["created_at"], m["id"]))

    def add_stream(self, source: IO[bytes], filename: str, purpose: str, file_id: str | None = None) -> dict[str, Any]:
        """Copy an upload in, durably; returns its metadata."""
        file_id = file_id or new_file_id()
        data = self._data(file_id)
        tmp = data.with_name(f".{data.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                shutil.copyfileobj(source, f, 1 << 20)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, data)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.folder)
        return self._record(file_id, filename, purpose, size)

    def add_bytes(self, content: bytes, filename: str, purpose: str, file_id: str | None = None) -> dict[str, Any]:
        file_id = file_id or new_file_id()
        atomic_write(self._data(file_id), content)
        return self._record(file_id, filename, purpose, len(content))

    def _record(self, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        meta = {"id": file_id, "bytes": size, "created_at": int(time.time()), "filename": filename, "purpose": purpose}
        atomic_write(self.folder / f"{file_id}.json", json.dumps(meta).encode())
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
