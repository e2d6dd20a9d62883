"""Run the real Spool daemon in this process with the fake backend: `python -m tests.run_spool CONFIG
[--once] [--delay S] [--no-watchdog]`. Used by the crash, signal and lock tests as a real subprocess."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool
from celeris_cli.spool.fsutil import LockHeld

from .spool_helpers import FakeBackend


class SlowBackend(FakeBackend):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def run(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(self.delay)
        return super().run(batch)


def main(argv: list[str]) -> int:
    cfg = load_config(Path(argv[0]))
    delay = float(argv[argv.index("--delay") + 1]) if "--delay" in argv else 0.0
    spool = Spool(cfg, lambda: SlowBackend(delay))
    if "--no-watchdog" in argv:
        spool._watch = lambda: None  # type: ignore[method-assign]
    try:
        return spool.run(once="--once" in argv)
    except LockHeld as e:
        print(f"Error: lock held by {e.holder}", file=sys.stderr)
        return 75


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
