"""The Batch API over the spool queue: a batch is a file in the queue's inbox, and its state is where the
queue has put that file.

`batches/<id>.json` (temp, fsync, rename) holds what the queue does not: the endpoint, the input file, the
metadata and the times. The rest is read from the queue's folders, in the order a file moves through them,
so a scan racing the daemon can only find the file further along, never miss it:

| the queue holds the file in | the batch is |
|---|---|
| `inputs/` (not claimed yet) | validating |
| `inputs/.work/` (claimed; counts from its journal) | in_progress |
| `inputs/.work/`, with its results published | finalizing |
| `processed/` | completed (cancelled, if a cancel was asked meanwhile) |
| `processed/quarantine/` | failed |

So `celeris status` and the API agree. At completion the queue's results and failure records become the
batch's output and error files, in OpenAI's batch format, under ids derived from the batch id (made again
after a crash, they are the same files). A batch whose metadata was written but whose file never reached
the inbox (the server died in between) is published again at startup.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from ..spool.config import BatchConfig
from ..spool.fsutil import atomic_write
from .batch_format import error_lines, failures_of, journal_counts, output_lines, request_lines
from .files import FileStore, derived_file_id
from .schema import APIError

log = logging.getLogger(__name__)

BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
TERMINAL = ("completed", "failed", "cancelled", "expired")
WINDOW_S = 24 * 3600


class BatchStore:
    def __init__(self, folder: Path, cfg: BatchConfig, files: FileStore, model: str) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.f = cfg.folders
        self.files = files
        self.model = model
        self.lock = threading.RLock()
        self.index: dict[str, dict[str, Any]] = {}
        for path in folder.glob("batch_*.json"):
            try:
                meta = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if BATCH_ID.match(str(meta.get("id", ""))):
                self.index[meta["id"]] = meta
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def recover(self) -> None:
        """Publish again the inputs of batches the server died before publishing."""
        for meta in list(self.index.values()):
            if meta["status"] == "validating" and self._where(meta)[0] == "missing":
                if self.files.get(meta["input_file_id"]) is None:  # deleted meanwhile: nothing to publish
                    gone = {
                        "code": "file_not_found",
                        "message": "the input file was deleted",
                        "param": None,
                        "line": None,
                    }
                    meta.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [gone]})
                    self._save(meta)
                    continue
                log.warning("batch %s: its file never reached the queue; publishing it now", meta["id"])
                self._publish(meta)

    def start(self, every_s: float = 0.5) -> None:
        """Follow the queue in the background, so times and output files come as the queue moves."""
        self.recover()
        self._thread = threading.Thread(target=self._follow, args=(every_s,), name="celeris-batches", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _follow(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for batch_id in list(self.index):
                try:
                    self.refresh(batch_id)
                except Exception as e:  # noqa: BLE001 - a bad batch must not stop following the others
                    log.warning("batch %s: %s", batch_id, e)

    # -- the API -----------------------------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        meta_in = self.files.get(input_file_id)
        if meta_in is None:
            raise APIError(404, f"no file {input_file_id!r}", "not_found_error", "input_file_id", "file_not_found")
        if meta_in["purpose"] != "batch":
            raise APIError(
                400, f"file {input_file_id} has purpose {meta_in['purpose']!r}, not 'batch'", param="input_file_id"
            )
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if window != "24h":
            raise APIError(400, "completion_window must be '24h'", param="completion_window")
        data = self.files.path(input_file_id).read_bytes()
        total = request_lines(data, endpoint)
        batch_id = f"batch_{secrets.token_hex(12)}"
        now = int(time.time())
        meta = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": window,
            "metadata": metadata,
            "status": "validating",
            "created_at": now,
            "total": total,
            "name": f"{batch_id}.jsonl",  # its name in the queue
        }
        with self.lock:
            self._save(meta)  # first: a crash before the publish is repaired at startup (`recover`)
            self._publish(meta)
        return self.view(meta)

    def get(self, batch_id: str) -> dict[str, Any] | None:
        if not BATCH_ID.match(batch_id) or batch_id not in self.index:
            return None
        return self.view(self.refresh(batch_id))

    def page(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        ordered = sorted(self.index.values(), key=lambda m: (m["created_at"], m["id"]), reverse=True)
        if after is not None:
            ids = [m["id"] for m in ordered]
            ordered = ordered[ids.index(after) + 1 :] if after in ids else []
        page = ordered[:limit]
        return [self.view(self.refresh(m["id"])) for m in page], len(ordered) > limit

    def cancel(self, batch_id: str) -> dict[str, Any] | None:
        if not BATCH_ID.match(batch_id) or batch_id not in self.index:
            return None
        with self.lock:
            meta = self.refresh(batch_id)
            if meta["status"] in TERMINAL:
                raise APIError(400, f"batch {batch_id} is {meta['status']}; it cannot be cancelled", param=None)
            if meta["status"] != "cancelling":
                meta["cancelling_at"] = int(time.time())
                try:  # not claimed yet: take it out of the inbox (an unlink the daemon's claim cannot race)
                    os.unlink(self.f.inputs / meta["name"])
                    meta.update(status="cancelled", cancelled_at=int(time.time()), completed=0, failed=0)
                except FileNotFoundError:  # claimed: the queue finishes it, then it is `cancelled`
                    meta["status"] = "cancelling"
                self._save(meta)
        return self.view(meta)

    # -- the queue's state -------------------------------------------------------------------------
    def refresh(self, batch_id: str) -> dict[str, Any]:
        with self.lock:
            meta = self.index[batch_id]
            if meta["status"] in TERMINAL:
                return meta
            before = dict(meta)
            where, claimed = self._where(meta)
            now = int(time.time())
            if where == "claimed" and claimed is not None:
                meta.setdefault("in_progress_at", now)
                meta["completed"], meta["failed"] = journal_counts(self.f.work / "journal" / f"{claimed}.jsonl")
                published = (self.f.outputs / f"{meta['name']}.results.jsonl").exists()
                if meta["status"] != "cancelling":
                    meta["status"] = "finalizing" if published else "in_progress"
                if published:
                    meta.setdefault("finalizing_at", now)
            elif where == "processed":
                self._finish(meta, now)
            elif where == "quarantined":
                recs = failures_of(self.f.logs / "failed.jsonl", meta["name"])
                meta.update(status="failed", failed_at=now, failed=0, completed=0)
                meta["errors"] = {
                    "object": "list",
                    "data": [{"code": r["code"], "message": r["message"], "param": None, "line": None} for r in recs],
                }
            elif where == "missing" and meta["status"] != "validating":
                meta.update(status="failed", failed_at=now)
                lost = "the queue no longer holds this batch's file"
                meta["errors"] = {
                    "object": "list",
                    "data": [{"code": "lost", "message": lost, "param": None, "line": None}],
                }
            if meta != before:
                self._save(meta)
            return meta

    def _where(self, meta: dict[str, Any]) -> tuple[str, str | None]:
        """Where the queue holds the batch's file, checked in the order it moves (see the module doc)."""
        name = meta["name"]
        if (self.f.inputs / name).exists():
            return "pending", None
        if self.f.work.is_dir():
            for entry in os.scandir(self.f.work):
                claim, dot, rest = entry.name.partition(".")
                if dot and rest == name and claim.isdigit():
                    return "claimed", claim
        if (self.f.processed / name).exists():
            return "processed", None
        if (self.f.quarantine / name).exists():
            return "quarantined", None
        return "missing", None

    def _finish(self, meta: dict[str, Any], now: int) -> None:
        """The queue has published the batch: its results and failure records become the output and error
        files (the same ids and bytes if this is done again after a crash)."""
        meta.setdefault("in_progress_at", now)
        meta.setdefault("finalizing_at", now)
        name = meta["name"]
        chat = meta["endpoint"] == "/v1/chat/completions"
        results = self.f.outputs / f"{name}.results.jsonl"
        out = output_lines(meta["id"], results, chat, self.model, meta["finalizing_at"])
        errors = error_lines(meta["id"], failures_of(self.f.logs / "failed.jsonl", name))
        if out:
            meta["output_file_id"] = self._write(meta, "output", out)
        if errors:
            meta["error_file_id"] = self._write(meta, "error", errors)
        meta.update(completed=len(out), failed=len(errors))
        if meta["status"] == "cancelling":
            meta.update(status="cancelled", cancelled_at=now)
        else:
            meta.update(status="completed", completed_at=now)

    def _write(self, meta: dict[str, Any], role: str, lines: list[dict[str, Any]]) -> str:
        file_id = derived_file_id(meta["id"], role)
        data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
        self.files.add_bytes(data, f"{meta['id']}_{role}.jsonl", "batch_output", file_id)
        return file_id

    def _publish(self, meta: dict[str, Any]) -> None:
        data = self.files.path(meta["input_file_id"]).read_bytes()
        atomic_write(self.f.inputs / meta["name"], data if data.endswith(b"\n") else data + b"\n")

    def _save(self, meta: dict[str, Any]) -> None:
        atomic_write(self.folder / f"{meta['id']}.json", json.dumps(meta).encode())
        self.index[meta["id"]] = meta

    def view(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The OpenAI batch object."""
        return {
            "id": meta["id"],
            "object": "batch",
            "endpoint": meta["endpoint"],
            "model": self.model,
            "errors": meta.get("errors"),
            "input_file_id": meta["input_file_id"],
            "completion_window": meta["completion_window"],
            "status": meta["status"],
            "output_file_id": meta.get("output_file_id"),
            "error_file_id": meta.get("error_file_id"),
            "created_at": meta["created_at"],
            "in_progress_at": meta.get("in_progress_at"),
            "expires_at": meta["created_at"] + WINDOW_S,
            "finalizing_at": meta.get("finalizing_at"),
            "completed_at": meta.get("completed_at"),
            "failed_at": meta.get("failed_at"),
            "expired_at": None,
            "cancelling_at": meta.get("cancelling_at"),
            "cancelled_at": meta.get("cancelled_at"),
            "request_counts": {
                "total": meta["total"],
                "completed": meta.get("completed", 0),
                "failed": meta.get("failed", 0),
            },
            "metadata": meta.get("metadata"),
        }
