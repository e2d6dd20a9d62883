"""Run the real Spool daemon in this process with the fake backend: `python -m tests.run_spool CONFIG
[--once] [--delay S] [--no-watchdog] [--fail-on TEXT] [--die-on TEXT] [--hang-on TEXT] [--count-file F]`.
Used by the crash, signal and lock tests as a real subprocess.

--fail-on: a batch holding a prompt with TEXT raises (an out-of-memory stand-in);
--die-on: the process SIGKILLs itself on such a batch (a segfault or OOM-killer stand-in);
--hang-on: such a batch never returns; --count-file: every decoded custom_id is appended there;
--hooks: what `celeris watch` says on stderr (up and watching; what a stop whose grace ran out kept);
--short-writes P: each os.write of more than one byte writes only half of it with probability P, and
returns that count without raising, as a filling filesystem does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from celeris_cli.errors import EXIT_LOCKED
from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool
from celeris_cli.spool.fsutil import LockHeld

from .spool_helpers import FakeBackend


class SlowBackend(FakeBackend):
    def __init__(self, delay: float, die_on: str | None, hang_on: str | None, count_file: str | None, **kw):  # type: ignore[no-untyped-def]
        super().__init__(**kw)
        self.delay = delay
        self.die_on = die_on
        self.hang_on = hang_on
        self.count_file = count_file

    def run(self, batch):  # type: ignore[no-untyped-def]
        prompts = [p.payload for p in batch]
        if self.die_on and any(self.die_on in p for p in prompts):
            os.kill(os.getpid(), signal.SIGKILL)
        while self.hang_on and any(self.hang_on in p for p in prompts):
            time.sleep(0.05)
        time.sleep(self.delay)
        out = super().run(batch)
        if self.count_file:
            with open(self.count_file, "a") as f:
                f.write("".join(p.request.custom_id + "\n" for p in batch))
        return out


def _opt(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def short_writes(p: float) -> None:
    import random

    real = os.write

    def write(fd, data):  # type: ignore[no-untyped-def]
        if len(data) > 1 and random.random() < p:
            return real(fd, bytes(data)[: len(data) // 2])
        return real(fd, data)

    os.write = write  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    cfg = load_config(Path(argv[0]))
    if _opt(argv, "--short-writes"):
        short_writes(float(_opt(argv, "--short-writes")))  # type: ignore[arg-type]
    delay = float(_opt(argv, "--delay") or 0.0)
    backend = SlowBackend(
        delay,
        _opt(argv, "--die-on"),
        _opt(argv, "--hang-on"),
        _opt(argv, "--count-file"),
        fail_on=_opt(argv, "--fail-on"),
    )
    if "--hooks" in argv:
        from celeris_cli.cli.queue import _expired, _watching

        spool = Spool(cfg, lambda: backend, on_watching=_watching, on_expired=_expired)
    else:
        spool = Spool(cfg, lambda: backend)
    if "--no-watchdog" in argv:
        spool._watch = lambda: None  # type: ignore[method-assign]
    try:
        return spool.run(once="--once" in argv)
    except LockHeld as e:
        print(f"Error: lock held by {e.holder}", file=sys.stderr)
        return EXIT_LOCKED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
