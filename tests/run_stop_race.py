"""`python -m tests.run_stop_race ROOT`: stop the real Spool daemon (in this process, fake backend) with
a SIGTERM raised at each line its idle loop runs while it sleeps or wakes, in turn, one daemon per line.
A stop signal handled while the loop holds a lock that the handler needs too (threading.Event's, for
one) would hang the daemon for good; the test that runs this gives it a deadline. Prints `stopped N`."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool

from .spool_helpers import FakeBackend, make_queue

LINES = 40  # more than the sleeping primitive runs between two wakes


class SignalAtLine:
    """A tracer: counts the lines run inside calls on `target` (and what they call) and raises SIGTERM at
    the `at`-th; nothing after."""

    def __init__(self, target: object, at: int) -> None:
        self.target = target
        self.at = at
        self.seen = 0
        self.depth = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or self.seen >= self.at:
            return None
        if self.depth == 0 and frame.f_locals.get("self") is not self.target:
            return None
        self.depth += 1
        return self.local

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self.depth -= 1
        elif event == "line" and self.seen < self.at:
            self.seen += 1
            if self.seen == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
        return self.local


def main(root: Path) -> int:
    stopped = 0
    for at in range(1, LINES + 1):
        cfg = load_config(make_queue(root / str(at), rescan_s=0.001, shutdown_grace_s=600))
        spool = Spool(cfg, FakeBackend)
        spool._watch = lambda: None  # type: ignore[method-assign]
        sys.settrace(SignalAtLine(spool.wake, at))
        try:
            spool.run(once=False)  # returns once the signal stopped it
        finally:
            sys.settrace(None)
        stopped += spool.stop_signal == signal.SIGTERM
    print(f"stopped {stopped}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
