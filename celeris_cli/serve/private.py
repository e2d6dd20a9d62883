"""The server's state on disk: private, durable, and honest about a full disk.

Uploads, outputs and batch records hold users' prompts and answers, so every file is created mode 0600 in
a folder kept at 0700 (whatever the umask), written to a temp name, fsynced and renamed. A write the disk
refuses for lack of room becomes a 507 naming the folder, never a bare 500; the temp file is removed.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import IO

from ..spool.fsutil import fsync_dir
from .schema import APIError

log = logging.getLogger(__name__)

FILE_MODE = 0o600
FOLDER_MODE = 0o700
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def private_folder(folder: Path) -> Path:
    """`folder` (and missing parents) made, and the folder itself kept at 0700."""
    folder.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    if stat.S_IMODE(folder.stat().st_mode) != FOLDER_MODE:
        os.chmod(folder, FOLDER_MODE)
    return folder


def _temp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_private(path: Path, data: bytes, mtime: float | None = None) -> None:
    """Replace `path` with `data` (mode 0600): readers see the old file or the new one, never a part.
    `mtime`: the time it says it was last written (set before the rename)."""
    copy_private(path, None, data, mtime)


def copy_private(path: Path, source: IO[bytes] | None, data: bytes = b"", mtime: float | None = None) -> int:
    """Write `source` (or `data`) to `path`, mode 0600, durably; returns the bytes written. On an error
    the temp file is removed and the error raised."""
    tmp = _temp(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with open(fd, "wb") as f:
            if source is not None:
                shutil.copyfileobj(source, f, 1 << 20)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        if mtime is not None:
            os.utime(tmp, (mtime, mtime))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


def no_room(e: OSError, folder: Path) -> APIError | None:
    """The API's answer to a write the disk refused for lack of room (None for any other error)."""
    if e.errno not in NO_ROOM:
        return None
    log.error("no space left on the disk holding %s: %s", folder, e)
    return APIError(
        507,
        f"the server's disk is full (no space left on the disk holding {folder}); try again later",
        "server_error",
        code="insufficient_storage",
    )


def key_file_warning(path: Path) -> str | None:
    """A warning (also logged) when the API key file can be read by its group or by others; None if not."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None  # reading it reports the error
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    message = f"warning: --api-key-file {path} is mode {mode:04o}: other users may read the keys (chmod 600 {path})"
    log.warning("%s", message)
    return message
