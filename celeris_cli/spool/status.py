"""The heartbeat: `logs/heartbeat.json`, rewritten at each state change, read by `celeris status`."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from .fsutil import atomic_write
from .ledger import now_iso

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.last_batch: float | None = None
        self.peak_memory_mb: float | None = None  # the last batch's

    def write(self, state: str, spool: Any) -> None:
        data = {
            "pid": os.getpid(),
            "time": now_iso(),
            "unix": time.time(),
            "state": state,
            "done": spool.counts.results,
            "failed": spool.counts.failures,
            "last_batch_unix": self.last_batch,
            "peak_memory_mb": self.peak_memory_mb,
        }
        try:
            atomic_write(self.path, json.dumps(data).encode(), durable=False)
        except OSError as e:
            log.warning("heartbeat: %s", e)


def read_heartbeat(path: Path, lock_holder: str | None) -> dict[str, Any] | None:
    """The last heartbeat, with its age; `stale` when it says running but its daemon is gone."""
    try:
        hb: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    now = time.time()
    hb["age_s"] = round(now - hb.get("unix", now), 1)
    last = hb.get("last_batch_unix")
    hb["last_batch_age_s"] = round(now - last, 1) if isinstance(last, (int, float)) else None
    if hb.get("state") != "stopped" and (lock_holder is None or not _alive(hb.get("pid"))):
        hb["last_state"], hb["state"] = hb.get("state"), "stale"
    return hb


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
