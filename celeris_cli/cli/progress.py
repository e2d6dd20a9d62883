"""Progress on stderr while answers are decoded: a Rich bar on a terminal (answers done, tokens/s, ETA),
plain lines every few seconds otherwise (logs, CI), nothing with --quiet. Also the guard that lets Ctrl-C
land only between two records, never inside one, and SIGTERM made to land as Ctrl-C does."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TextIO


class Progress:
    """Answers done of `total`; the rate and the ETA count only the answers done since the clock started
    (`start`: those a resumed run found finished are not this run's work)."""

    def __init__(
        self,
        total: int,
        quiet: bool,
        every_s: float = 5.0,
        stream: TextIO | None = None,
        label: str = "generate",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.quiet = quiet
        self.label = label
        self.every_s = every_s
        self.stream = stream or sys.stderr
        self.clock = clock
        self.done = self.start = 0
        self.t0 = self.began = clock()  # t0: the rate's clock; began: the run's, for the time shown
        self._last_line = self.t0
        self._started = False
        self._steady = False  # report(): the rate's clock restarted at the first answers
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if not self.quiet and self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn(self.label),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),  # ours: Rich's own needs many updates in its last 30 s
                console=Console(file=self.stream),
                transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("generate", total=self.total, rate="", eta=_clock_time(None))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, exc, tb)

    @contextmanager
    def hidden(self) -> Iterator[None]:
        """The bar taken off the terminal while something else writes to it (answers on stdout), and drawn
        again below: written under a live bar, an answer would be glued to the bar's line and that line
        left behind."""
        if self._bar is None:
            yield
            return
        self._bar.stop()  # transient: the bar's line is erased and the cursor left at its start
        try:
            yield
        finally:
            self._bar.start()

    def report(self, done: int, total: int) -> None:
        """Absolute counts, as `celeris batch`'s `run_file` gives them: `done` answers (results and failures)
        of `total` lines. The first report starts the clock; what was done by then is not this run's. The
        rate is counted from the first answers on: the first batch to finish also waited for the batches
        decoded beside it, so counted from the start the pipeline's filling would read as slowness (an ETA
        three times too long on a real engine with batches in flight)."""
        if not self._started:
            self._started = True
            self.done = self.start = done
            self.t0 = self.began = self._last_line = self.clock()
            if self._bar is not None:
                self._bar.update(self._task, completed=done, total=total)
        elif not self._steady and done > self.done:
            self._steady = True
            self.start, self.t0 = done, self.clock()
        self.total = total
        self.advance(done - self.done)

    def advance(self, n: int, tokens: int | None = None) -> None:
        """`n` more answers are done; `tokens` generated so far (None: show answers per second)."""
        self._started = True
        self.done += n
        now = self.clock()
        elapsed = max(now - self.t0, 1e-9)
        ours = self.done - self.start  # answered since the clock started
        rate = f"{_figure(tokens / elapsed)} tok/s" if tokens is not None else f"{_figure(ours / elapsed)} answers/s"
        # the time left at this run's own pace since its clock started (None before it has answered any)
        eta = elapsed / ours * max(self.total - self.done, 0) if ours > 0 else None
        if self._bar is not None:
            self._bar.update(self._task, total=self.total, advance=n, rate=rate, eta=_clock_time(eta))
        elif not self.quiet and eta is not None and self.done < self.total and now - self._last_line >= self.every_s:
            self.stream.write(
                f"{self.label}: {self.done}/{self.total} answers, {rate}, {now - self.began:.0f}s, eta {eta:.0f}s\n"
            )
            self.stream.flush()
            self._last_line = now


def _clock_time(seconds: float | None) -> str:
    """H:MM:SS, as Rich writes times; `-:--:--` when there is no estimate yet."""
    if seconds is None:
        return "-:--:--"
    whole = int(seconds + 0.5)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _figure(rate: float) -> str:
    """A rate with two significant digits below 10 (a slow run's 0.13 answers/s is not 0.0)."""
    return f"{rate:.1f}" if rate >= 10 else f"{rate:.2g}"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, systemd), raised where Ctrl-C raises KeyboardInterrupt, so that what is
    finished is kept the same way; the command then exits 143 (`interrupt_code`)."""


def interrupt_code(e: KeyboardInterrupt) -> int:
    from ..errors import EXIT_INTERRUPTED, EXIT_TERMINATED

    return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED


def interrupted(e: KeyboardInterrupt) -> str:
    """How an interrupt is named on stderr."""
    return "Terminated (SIGTERM)" if isinstance(e, Terminated) else "Interrupted"


def _raise(signum: int, frame: Any) -> None:
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside the block, SIGTERM interrupts as Ctrl-C does (`Terminated`); the previous handler after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a SIGINT or SIGTERM that arrives inside the block until the block is done, then raise it
    (`KeyboardInterrupt`, `Terminated`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    # SIGTERM only where it interrupts (`sigterm_interrupts`); elsewhere it keeps its own meaning
    held = (signal.SIGINT, signal.SIGTERM) if signal.getsignal(signal.SIGTERM) is _raise else (signal.SIGINT,)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            _raise(caught[0], None)
