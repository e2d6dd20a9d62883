"""The queue's folders: which there are, the locks in them, and making them exist and writable.

`watch` creates the folders that are missing when it starts (a fresh root needs only its config), and
again whenever one is deleted under it; the lock of a folder created again is taken again, so a second
daemon cannot start on it meanwhile.

A queue holds every tenant's prompts and answers, so it is private unless its config says `private:
false`: its folders are made (and kept) 0700, and a process that writes in them writes 0600 files (a
umask of 077, which also covers the files other modules write there: results, logs, journals). The
Prometheus text file, for node_exporter, is the exception: it holds counts only and stays readable.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import ConfigError
from .config import BatchConfig, Folders
from .fsutil import FolderLocks

log = logging.getLogger(__name__)

LOCK_NAME = ".celeris.lock"
PRIVATE_UMASK = 0o077
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


def create_missing(f: Folders, private: bool = True) -> list[tuple[str, Path]]:
    """Create the folders that do not exist (0700 when `private`); returns those created. ConfigError when
    one cannot be."""
    made = []
    for key, folder in queue_folders(f):
        if not folder.is_dir():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                if private:
                    folder.chmod(0o700)
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


def make_private(cfg: BatchConfig) -> None:
    """For a process about to write in a private queue (`private: true`, the default): files it creates
    from now on are 0600 (umask 077), and the queue's folders and logs that already exist lose their group
    and other bits (a queue made before, or by hand; no bit is added, so a read-only folder stays so). One
    the process does not own is left with a warning."""
    if not cfg.private:
        return
    os.umask(PRIVATE_UMASK)
    f = cfg.folders
    targets = [folder for _, folder in queue_folders(f) if folder.is_dir()]
    targets += list(f.logs.glob("*.jsonl")) if f.logs.is_dir() else []
    for path in targets:
        try:
            mode = path.stat().st_mode & 0o777
            if mode & PRIVATE_UMASK:
                path.chmod(mode & ~PRIVATE_UMASK)
        except OSError as e:
            log.warning("cannot make %s private (%s); set `private: false` to leave the modes alone", path, e)
