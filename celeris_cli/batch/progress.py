"""Progress of a batch run on stderr: a Rich bar on a terminal, a log line every few seconds otherwise,
both with prompts/s and an ETA."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any


class Progress:
    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> Progress:
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self.bar = Bar("batch", BarColumn(), MofNCompleteColumn(), "{task.fields[rate]}", TimeRemainingColumn(),
                           console=Console(stderr=True), transient=True)  # fmt: skip
            self.bar.__enter__()
        return self

    def update(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task("batch", total=total, rate="")
            self.bar.update(self.task, completed=done, rate=f"{rate:.1f} prompts/s")
        elif elapsed - self.last >= self.every_s or done == total:
            self.last = elapsed
            eta = (total - done) / rate if rate > 0 else float("inf")
            print(f"[batch] {done}/{total} requests, {rate:.1f} prompts/s, eta {eta:.0f}s", file=sys.stderr, flush=True)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.__exit__(kind, exc, tb)
