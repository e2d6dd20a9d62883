"""Signals: the first SIGTERM/SIGINT stops intake and starts the grace timer; a second exits at once
(startup recovery makes that safe). Signals can only be handled on the main thread."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
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
