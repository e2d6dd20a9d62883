"""The queue's folders: which there are, the locks in them, and making them exist and writable.

`watch` creates the folders that are missing when it starts (a fresh root needs only its config), and
again whenever one is deleted under it; the lock of a folder created again is taken again, so a second
daemon cannot start on it meanwhile.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .config import BatchConfig, Folders
from .fsutil import FolderLocks

LOCK_NAME = ".celeris.lock"
HEARTBEAT = "heartbeat.json"


def queue_lock(cfg: BatchConfig) -> FolderLocks:
    f = cfg.folders
    return FolderLocks([f.inputs, f.outputs, f.processed, f.logs], LOCK_NAME)


def queue_folders(f: Folders) -> list[tuple[str, Path]]:
    """Every folder the queue uses, with the config key it belongs to, parents first."""
    return [
        ("inputs", f.inputs),
        ("inputs", f.work),
        ("outputs", f.outputs),
        ("processed", f.processed),
        ("processed", f.quarantine),
        ("logs", f.logs),
    ]


def create_missing(f: Folders) -> list[tuple[str, Path]]:
    """Create the folders that do not exist; returns those created. ConfigError when one cannot be."""
    made = []
    for key, folder in queue_folders(f):
        if not folder.is_dir():
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"folders.{key}: cannot create {folder} ({e.strerror})") from None
            made.append((key, folder))
    return made


def check_writable(key: str, folder: Path) -> None:
    """A folder the queue cannot write in is a config error at startup, not a crash at the first publish."""
    probe = folder / f".celeris-probe-{os.getpid()}.tmp"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"folders.{key}: cannot write in {folder} ({e.strerror})") from None
