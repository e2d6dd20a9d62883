"""The Batch API over the spool queue: a batch is a few files in the queue's inbox (its parts, `parts.py`),
and its state is where the queue has put them.

`batches/<id>.json` (temp, fsync, rename, mode 0600) holds what the queue does not: the endpoint, the input
file, the metadata, the times, the key that made it and its parts' states; `batches/<id>.input` is a hard
link to its input, so a part can be published (and failed lines retried) after the file is deleted.

| the queue holds its parts in | the batch is |
|---|---|
| `inputs/` only (none claimed yet) | validating |
| `inputs/.work/` (counts from the claims' journals), or some done and more to go | in_progress |
| every part answered, output files not written yet | finalizing |
| `processed/` (every part) | completed (cancelled, if a cancel was asked meanwhile) |
| `processed/quarantine/` (every part) | failed |

Only the follower thread (and POSTs) write: a status read (`GET`) only looks, so it answers on a full
disk. At completion the queue's results and failure records become the batch's output and error files,
under ids derived from the batch id (made again after a crash, they are the same files). A part recorded
as published that the queue never held and never answered (the server died in between) is published again
at startup; one the queue answered, or was seen holding, never is.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from ..spool.config import BatchConfig
from ..spool.ledger import read_jsonl
from .batch_format import failures_of, journal_counts, request_lines
from .batch_output import assemble
from .batch_record import BATCH_ID, ENDPOINTS, metadata_problem, read_record, unreadable
from .batch_view import batch_object
from .files import FileStore, derived_file_id
from .parts import (
    OPEN,
    OUTSTANDING,
    QUEUED,
    input_lines,
    journal_of,
    locate,
    part_bytes,
    part_line_numbers,
    plan,
    results_of,
)
from .private import copy_private, no_room, private_folder, write_private
from .schema import APIError

log = logging.getLogger(__name__)

TERMINAL = ("completed", "failed", "cancelled", "expired")


class BatchStore:
    def __init__(self, folder: Path, cfg: BatchConfig, files: FileStore, model: str) -> None:
        self.folder = private_folder(folder)
        self.cfg = cfg
        self.f = cfg.folders
        self.files = files
        self.model = model
        self.lock = threading.RLock()
        self.index: dict[str, dict[str, Any]] = {}
        self.saved: dict[str, str] = {}  # what is on disk, to write only what changed
        for path in sorted(folder.glob("batch_*.json")):
            if not BATCH_ID.match(path.stem):
                continue
            meta, why = read_record(path)
            if why is not None:  # reported as a failed batch whose error says why; the file is left alone
                log.warning("batch record %s cannot be read (%s); listed as failed", path, why)
            else:
                self.saved[meta["id"]] = json.dumps(meta)
            self.index[meta["id"]] = meta
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def recover(self) -> None:
        """Publish again the parts the server recorded as published but the queue never held nor answered."""
        with self.lock:
            for meta in list(self.index.values()):
                if meta["status"] in TERMINAL or meta["status"] == "cancelling":
                    continue
                for part in meta["parts"]:
                    if part["state"] == "fed" and locate(self.f, part["name"])[0] == "missing":
                        if not self._answered(part["name"]):
                            log.warning("batch %s: %s never reached the queue; publishing it", meta["id"], part["name"])
                            try:
                                self._publish(meta, part)
                            except KeyError:  # a record from before parts, whose input was deleted
                                part["state"] = "lost"

    def start(self, every_s: float = 0.2) -> None:
        """Follow the queue in the background: feed parts, write output files, keep the records."""
        try:
            self.recover()
        except OSError as e:  # a full disk: the follower tries again
            log.warning("cannot publish the batches' parts yet: %s", e)
        self._thread = threading.Thread(target=self._follow, args=(every_s,), name="celeris-batches", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _follow(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for batch_id in [i for i, m in list(self.index.items()) if m["status"] not in TERMINAL]:
                try:
                    self.advance(batch_id)
                except Exception as e:  # noqa: BLE001 - a bad batch (or a full disk) must not stop the others
                    log.warning("batch %s: %s", batch_id, e)

    def advance(self, batch_id: str) -> dict[str, Any]:
        """Observe the queue, publish the next parts, write the output files when every part is answered,
        and save the record if it changed."""
        with self.lock:
            meta = self.index[batch_id]
            if meta["status"] not in TERMINAL:
                if self._observe(meta):
                    self._finish(meta)
                else:
                    self._feed(meta)
            self._save(meta)
            return meta

    # -- the API -----------------------------------------------------------------------------------
    def create(
        self, owner: str | None, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None
    ) -> dict[str, Any]:
        if (wrong := metadata_problem(metadata)) is not None:  # before anything is stored
            raise APIError(400, f"metadata: {wrong}", param="metadata")
        meta_in = self.files.get(input_file_id)
        if meta_in is None or meta_in.get("owner") != owner:
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
        total, renamed = request_lines(data, endpoint)
        if total == 0:
            raise APIError(400, f"file {input_file_id} holds no request line", param="input_file_id")
        batch_id = f"batch_{secrets.token_hex(12)}"
        meta = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": window,
            "metadata": metadata,
            "status": "validating",
            "created_at": int(time.time()),
            "total": total,
            "owner": owner,
            "parts": plan(batch_id, data, self.cfg.batch_size, self.cfg.max_file_requests),
        }
        if renamed:
            meta["renamed"] = renamed
        with self.lock:
            try:
                self._keep_input(batch_id, input_file_id)
                self._save(meta)  # first: a part published is always a part recorded (`recover`)
            except OSError as e:
                self._input(batch_id).unlink(missing_ok=True)
                self.index.pop(batch_id, None)
                raise no_room(e, self.folder) or e from None
            try:
                self._feed(meta)
                self._save(meta)
            except OSError as e:  # recorded: the follower publishes it when it can
                log.warning("batch %s: cannot publish its first parts yet: %s", batch_id, e)
        return self.view(meta)

    def owned(self, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        meta = self.index.get(batch_id) if BATCH_ID.match(batch_id) else None
        return meta if meta is not None and meta.get("owner") == owner else None

    def get(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The batch as the queue holds it now; writes nothing."""
        with self.lock:
            meta = self.owned(batch_id, owner)
            return None if meta is None else self._look(meta)

    def _look(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The batch object of a record as the queue holds it now; a record that breaks on the way (one no
        check foresaw) is reported as unreadable, and the others are still answered."""
        try:
            self._observe(meta)
            view = self.view(meta)
            json.dumps(view, ensure_ascii=False).encode("utf-8")
            return view
        except Exception as e:  # noqa: BLE001 - one record must not take a listing down
            log.warning("batch %s: its record cannot be shown: %r", meta.get("id"), e)
            return self.view(unreadable(self.folder / f"{meta.get('id')}.json", type(e).__name__, meta))

    def page(self, owner: str | None, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        with self.lock:  # batches are created meanwhile
            mine = [m for m in self.index.values() if m.get("owner") == owner]
        ordered = sorted(mine, key=lambda m: (m["created_at"], m["id"]), reverse=True)
        if after is not None:
            ids = [m["id"] for m in ordered]
            ordered = ordered[ids.index(after) + 1 :] if after in ids else []
        with self.lock:
            return [self._look(m) for m in ordered[:limit]], len(ordered) > limit

    def cancel(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """Parts not claimed yet are taken out of the inbox and none is published any more; the claimed
        ones finish, and their answers are the batch's output. `cancelled` when the last of them is done."""
        with self.lock:
            meta = self.owned(batch_id, owner)
            if meta is None:
                return None
            self._observe(meta)
            if meta["status"] in TERMINAL:
                raise APIError(400, f"batch {batch_id} is {meta['status']}; it cannot be cancelled", param=None)
            try:
                if meta["status"] != "cancelling":
                    meta.update(status="cancelling", cancelling_at=int(time.time()))
                    self._save(meta)  # first: a restart never publishes a part again for a cancelled batch
                for part in meta["parts"]:
                    if part["state"] == "new":
                        part["state"] = "dropped"
                    elif part["state"] == "fed":
                        try:  # an unlink the daemon's claim (a rename) cannot race: one of them wins
                            os.unlink(self.f.inputs / part["name"])
                            part["state"] = "dropped"
                        except FileNotFoundError:
                            pass  # claimed meanwhile: it finishes
                if self._observe(meta):
                    self._finish(meta)
                self._save(meta)
            except OSError as e:
                raise no_room(e, self.folder) or e from None
            return self.view(meta)

    def retry(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """A new batch of the lines of a finished one that have no answer: those that failed, and those
        that never ran (a cancelled batch's dropped parts, a part the queue refused or lost), as its input
        lines, each with its custom_id."""
        meta = self.owned(batch_id, owner)
        if meta is None:
            return None
        if "unreadable" in meta:
            raise APIError(400, f"the record of batch {batch_id} cannot be read ({meta['unreadable']})", param=None)
        if meta["status"] not in TERMINAL:
            raise APIError(400, f"batch {batch_id} is {meta['status']}; retry it once it has ended", param=None)
        unrun = [p for p in meta["parts"] if p["state"] != "done"]
        if not meta.get("failed_lines") and not unrun:
            raise APIError(400, f"batch {batch_id} has no failed line and none that never ran to retry", param=None)
        kept = self._input(batch_id)
        if not kept.exists():  # a record from before inputs were kept: its input file, if it is still there
            if self.files.get(meta["input_file_id"]) is None:
                raise APIError(400, f"the input of batch {batch_id} was deleted; nothing to retry", param=None)
            kept = self.files.path(meta["input_file_id"])
        whole = kept.read_bytes()
        lines = sorted({*(meta.get("failed_lines") or []), *(n for p in unrun for n in part_line_numbers(whole, p))})
        data = input_lines(whole, lines, meta.get("renamed"))
        try:
            new = self.files.add_bytes(data, f"{batch_id}_retry.jsonl", "batch", owner=owner)
        except OSError as e:
            raise no_room(e, self.files.folder) or e from None
        return self.create(owner, new["id"], meta["endpoint"], "24h", {"retry_of": batch_id})

    # -- the queue's state -------------------------------------------------------------------------
    def _observe(self, meta: dict[str, Any]) -> bool:
        """Update the parts' states, the counts and the status from where the queue holds the parts; True
        when every part is answered (or dropped) and the output files are due. Reads only."""
        if meta["status"] in TERMINAL:
            return False
        for part in meta["parts"]:
            if part["state"] not in QUEUED:
                continue
            where, claim = locate(self.f, part["name"])
            if where == "claimed" and claim is not None:
                part["state"] = "seen"
                part["completed"], part["failed"] = journal_counts(journal_of(self.f, claim))
            elif where == "processed" or (where == "missing" and self._answered(part["name"])):
                part["state"] = "done"
                part["completed"] = sum(1 for _ in read_jsonl(results_of(self.f, part["name"])))
                part["failed"] = len(failures_of(self.f.logs / "failed.jsonl", part["name"]))
            elif where == "quarantined":
                part["state"] = "quarantined"
                recs = failures_of(self.f.logs / "failed.jsonl", part["name"])
                part["errors"] = [{"code": r["code"], "message": r["message"]} for r in recs]
            elif where == "missing":
                part["state"] = "lost"  # the queue no longer holds it and never answered it
        now = int(time.time())
        parts = meta["parts"]
        meta["completed"] = sum(p.get("completed", 0) for p in parts if p["state"] in ("seen", "done"))
        meta["failed"] = sum(p.get("failed", 0) for p in parts if p["state"] in ("seen", "done"))
        cancelling = meta["status"] == "cancelling"
        still = [p for p in parts if p["state"] in (QUEUED if cancelling else OPEN)]
        if any(p["state"] in ("seen", "done") for p in parts):
            meta.setdefault("in_progress_at", now)
        if not still:
            meta.setdefault("finalizing_at", now)
            if not cancelling:
                meta["status"] = "finalizing"
            return True
        if not cancelling and "in_progress_at" in meta:
            meta["status"] = "in_progress"
        return False

    def _answered(self, name: str) -> bool:
        return results_of(self.f, name).exists() or bool(failures_of(self.f.logs / "failed.jsonl", name))

    def _feed(self, meta: dict[str, Any]) -> None:
        """Publish parts until `OUTSTANDING` are in the queue; each recorded (saved) before it is published."""
        if meta["status"] in (*TERMINAL, "cancelling"):
            return
        live = sum(1 for p in meta["parts"] if p["state"] in QUEUED)
        for part in meta["parts"]:
            if live >= OUTSTANDING:
                break
            if part["state"] == "new":
                part["state"] = "fed"
                try:
                    self._save(meta)
                    self._publish(meta, part)
                except OSError:
                    part["state"] = "new"
                    raise
                live += 1

    def _finish(self, meta: dict[str, Any]) -> None:
        """Every part is answered (or dropped): the queue's results and failure records become the output
        and error files (the same ids and bytes if this is done again after a crash)."""
        now = int(time.time())
        meta.setdefault("in_progress_at", now)
        out, errors, problems, failed_lines = assemble(meta, self.f, self.model)
        if out:
            meta["output_file_id"] = self._write(meta, "output", out)
        if errors:
            meta["error_file_id"] = self._write(meta, "error", errors)
        if problems:
            data = [{**p, "param": None, "line": None} for p in problems]
            meta["errors"] = {"object": "list", "data": data}
        meta["failed_lines"] = failed_lines
        meta.update(completed=len(out), failed=len(errors))
        if meta["status"] == "cancelling":
            meta.update(status="cancelled", cancelled_at=now)
        elif problems and not out and not errors:
            meta.update(status="failed", failed_at=now)
        else:
            meta.update(status="completed", completed_at=now)

    def _write(self, meta: dict[str, Any], role: str, lines: list[dict[str, Any]]) -> str:
        file_id = derived_file_id(meta["id"], role)
        data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
        self.files.add_bytes(data, f"{meta['id']}_{role}.jsonl", "batch_output", file_id, owner=meta.get("owner"))
        return file_id

    def _input(self, batch_id: str) -> Path:
        return self.folder / f"{batch_id}.input"

    def _keep_input(self, batch_id: str, file_id: str) -> None:
        """A hard link to the input (a copy where links are refused): parts and retries outlive a delete."""
        try:
            os.link(self.files.path(file_id), self._input(batch_id))
        except OSError as e:
            if no_room(e, self.folder) is not None:
                raise
            with open(self.files.path(file_id), "rb") as src:
                copy_private(self._input(batch_id), src)

    def _publish(self, meta: dict[str, Any], part: dict[str, Any]) -> None:
        kept = self._input(meta["id"])
        data = (kept if kept.exists() else self.files.path(meta["input_file_id"])).read_bytes()
        # whole when it appears (a rename), so dated past the queue's settle time: claimed at once
        settled = time.time() - self.cfg.settle_s - 1
        write_private(self.f.inputs / part["name"], part_bytes(data, part, meta.get("renamed")), mtime=settled)

    def _save(self, meta: dict[str, Any]) -> None:
        if "unreadable" in meta:  # never written over: the file on disk is the evidence
            return
        text = json.dumps(meta)
        self.index[meta["id"]] = meta
        if self.saved.get(meta["id"]) != text:
            write_private(self.folder / f"{meta['id']}.json", text.encode())
            self.saved[meta["id"]] = text

    def view(self, meta: dict[str, Any]) -> dict[str, Any]:
        return batch_object(meta, self.model)
