"""What wakes or stops the loop. Signals: the first SIGTERM/SIGINT stops intake and starts the grace
timer; a second exits at once (startup recovery makes that safe); they can only be handled on the main
thread. watchdog events only wake the loop (they are hints, not truth: the loop rescans anyway)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install(on_stop: Callable[[int], None], grace_s: float, on_grace_expired: Callable[[], None]) -> dict[int, Any]:
    """Install the handlers; returns the ones replaced, for `restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    stopping = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        if stopping.is_set():
            os._exit(128 + signum)  # second signal: at once
        stopping.set()
        on_stop(signum)
        timer = threading.Timer(grace_s, on_grace_expired)
        timer.daemon = True
        timer.start()

    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def watch(folder: Path, wake: threading.Event) -> Any:
    """A watchdog observer that sets `wake` on any event in `folder`; None without watchdog."""
    try:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer
    except ImportError:  # pragma: no cover - watchdog is a dependency; rescans still work without it
        return None

    class Wake(FileSystemEventHandler):
        def on_any_event(self, event: Any) -> None:
            wake.set()

    observer = Observer()
    observer.schedule(Wake(), str(folder), recursive=False)
    observer.daemon = True
    observer.start()
    return observer
