"""Filesystem primitives the queue's guarantees rest on (Maildir / Postfix style).

Publish = write a temp name, fsync, rename, fsync the directory. Claim = rename. Crash points let the
crash tests kill the process at named places (`CELERIS_CRASH_AT=name`); in normal runs they are no-ops.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CRASH_ENV = "CELERIS_CRASH_AT"
CRASH_EXIT = 86


def crashpoint(name: str) -> None:
    """Die at once, without cleanup, when the crash tests ask for this point."""
    if os.environ.get(CRASH_ENV) == name:
        os._exit(CRASH_EXIT)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path, data: bytes, crash_name: str | None = None, sync_dir: bool = True, durable: bool = True
) -> None:
    """Replace `path` with `data` so that readers see the old file or the new one, never a part. On an
    I/O error (a full disk, a read-only folder) the temp file is removed and the error raised.
    `sync_dir=False`: the caller fsyncs the folder once for many files; `durable=False`: no fsync at all
    (a heartbeat, which only has to be whole)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # two writers never share a temp file
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if crash_name:
            crashpoint(crash_name)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir and durable:
        fsync_dir(path.parent)


def stage(path: Path, data: bytes) -> Path:
    """The first half of a group publish: write `.name.tmp` beside `path`, not yet fsynced. Then
    `sync_folder` once for the group, then `os.replace` each temp file and `fsync_dir` once."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def sync_folder(folder: Path, files: list[Path]) -> None:
    """Make `files` durable: one syncfs of their filesystem (Linux), else an fsync per file."""
    if _syncfs_fn is not None:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _syncfs_fn(fd) == 0:
                return
        finally:
            os.close(fd)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _renameat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.renameat2
    except (OSError, AttributeError):
        return None


_renameat2_fn = _renameat2()


def _syncfs() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


_syncfs_fn = _syncfs()


def rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename unless `dst` exists (atomically: renameat2 RENAME_NOREPLACE, else link + unlink). Returns
    False when `dst` exists, so recovery can never overwrite a file that arrived meanwhile."""
    if _renameat2_fn is not None:
        rc = _renameat2_fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS):  # a filesystem without the flag: fall back below
            raise OSError(err, os.strerror(err), str(src))
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    os.unlink(src)
    return True


def move(src: Path, dst: Path) -> None:
    """Atomic rename within one filesystem, made durable in both directories."""
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data`: os.write may write less than asked without raising (a filling tmpfs)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no space left: a write made no progress")
        view = view[n:]


def _whole_lines_end(fd: int, size: int) -> int:
    """The offset just past the last newline of the file (0 if none): where a torn tail begins."""
    end = size
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


def append_line(path: Path, line: str, crash_name: str | None = None, durable: bool = True) -> None:
    """Append one line (or several joined by newlines, in one write and one fsync), complete or not at
    all: a short write is continued, and on an error (a full disk) the file is cut back to where it was.
    A torn tail left by a crash mid-write is cut off first, so the record it belonged to is written
    again whole by whoever redoes it."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            size = _whole_lines_end(fd, size)
            os.ftruncate(fd, size)
        if crash_name and os.environ.get(CRASH_ENV) == crash_name:
            os.write(fd, data[: len(data) // 2])
            os._exit(CRASH_EXIT)
        try:
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, size)  # absent rather than torn
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


@contextmanager
def waiting_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` for a short critical section, waiting for another holder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class LockHeld(Exception):
    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class QueueLock:
    """flock on one lock file; the file records the holder's pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            raise LockHeld(holder or "unknown") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def holder(self) -> str | None:
        """Who holds the lock now, or None when nobody does (checked without taking it)."""
        if not self.path.exists():
            return None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


class FolderLocks:
    """A queue owns every folder it writes: one flock in each (inbox, outputs, processed, logs). Two
    configs that share any folder cannot both run; queues that share none never block each other."""

    def __init__(self, folders: list[Path], name: str) -> None:
        unique = sorted({f.resolve() for f in folders})
        self.locks = [QueueLock(f / name) for f in unique]

    def acquire(self) -> None:
        taken: list[QueueLock] = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
        except LockHeld as e:
            for lock in taken:
                lock.release()
            raise LockHeld(f"{e.holder}, on {lock.path.parent}") from None

    def release(self) -> None:
        for lock in self.locks:
            lock.release()

    def retake(self, folder: Path) -> None:
        """Lock a folder again after it was deleted and created anew (the old lock went with it)."""
        for lock in self.locks:
            if lock.path.parent == folder.resolve():
                lock.release()
                lock.acquire()

    def holder(self) -> str | None:
        for lock in self.locks:
            who = lock.holder()
            if who is not None:
                return who
        return None
