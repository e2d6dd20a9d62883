"""What wakes or stops the loop. Signals: the first SIGTERM/SIGINT stops intake and starts the grace
timer; a second exits at once (startup recovery makes that safe); they can only be handled on the main
thread. watchdog events only wake the loop (they are hints, not truth: the loop rescans anyway).

A Python signal handler runs on the main thread between two of its bytecodes, so it must not take a
lock the main thread may hold at that moment. threading.Event does: its wait and clear hold the lock
its set takes, and a SIGTERM that arrived there hung the daemon for good (found by CI; pinned by
tests/run_stop_race.py). So the loop sleeps on a self-pipe (`Wake`), the handler only sets flags and
writes to pipes, and the rest of a stop (its event record, the grace timer) runs on a thread of its own.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Wake:
    """A flag the loop sleeps on, set from a signal handler or another thread without taking any lock:
    a byte in a non-blocking pipe."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # the pipe is full: it is set already
            pass

    def wait(self, timeout: float | None) -> bool:
        """Sleep until set or `timeout` seconds; returns whether it was set. It stays set until `clear`."""
        readable, _, _ = select.select([self._read], [], [], timeout)
        return bool(readable)

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def __del__(self) -> None:
        for fd in (getattr(self, "_read", None), getattr(self, "_write", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


@dataclass
class Installed:
    """The handlers in place: what they replaced, and the grace thread's pipes."""

    previous: dict[int, Any] = field(default_factory=dict)
    stopped: Wake | None = None  # set by the handler: the grace thread starts counting
    done: Wake | None = None  # set by `restore`: the grace thread ends without firing
    ended: list[bool] = field(default_factory=list)


def install(
    on_stop: Callable[[int], None],
    grace_s: float,
    on_grace_expired: Callable[[], None],
    on_stopping: Callable[[int], None],
) -> Installed:
    """Install the handlers. `on_stop(signum)` runs in the handler: it may only set flags and `Wake`s.
    `on_stopping(signum)` (an event record, say) then runs on the grace thread, which calls
    `on_grace_expired()` `grace_s` seconds after the signal unless `restore` came first."""
    if threading.current_thread() is not threading.main_thread():
        return Installed()
    stopped, done = Wake(), Wake()
    installed = Installed(stopped=stopped, done=done)
    caught: list[int] = []  # appending to a list takes no lock

    def handler(signum: int, frame: Any) -> None:
        if caught:
            os._exit(128 + signum)  # second signal: at once
        caught.append(signum)
        on_stop(signum)
        stopped.set()

    def grace() -> None:
        stopped.wait(None)
        if installed.ended:
            return
        on_stopping(caught[0])
        if not done.wait(grace_s):
            on_grace_expired()

    thread = threading.Thread(target=grace, name="celeris-grace", daemon=True)
    thread.start()
    installed.previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    return installed


def restore(installed: Installed) -> None:
    """Put the replaced handlers back and end the grace thread."""
    for signum, handler in installed.previous.items():
        signal.signal(signum, handler)
    installed.ended.append(True)
    for wake in (installed.done, installed.stopped):
        if wake is not None:
            wake.set()


def watch(folder: Path, wake: Wake) -> Any:
    """A watchdog observer that sets `wake` on any event in `folder`; None without watchdog."""
    try:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer
    except ImportError:  # pragma: no cover - watchdog is a dependency; rescans still work without it
        return None

    class Waker(FileSystemEventHandler):
        def on_any_event(self, event: Any) -> None:
            wake.set()

    observer = Observer()
    observer.schedule(Waker(), str(folder), recursive=False)
    observer.daemon = True
    observer.start()
    return observer
