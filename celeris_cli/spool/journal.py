"""The journal of one claimed file: what is decided about its requests, kept across stops and crashes.

`inputs/.work/journal/<claim>.jsonl`, appended and fsynced, one JSON object a line:
- `{"claim": n}`: the file was resumed (claim n; the first claim writes nothing);
- `{"try": [lines], "claim": n}`: these lines are about to be decoded;
- `{"outcomes": [{"line", "body"} | {"line", "failure"}]}`: a finished batch, decided once for good;
- `{"stopped": [lines], "claim": n}`: a clean stop, with the lines that were in flight.

On resume, decided lines are never decoded again. A line that was in flight when the daemon died or was
stopped `max_claims` times is poison: it gets a failure record and the rest of the file is served.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fsutil import append_line
from .ledger import dumps, read_jsonl

log = logging.getLogger(__name__)


@dataclass
class JournalState:
    claims: int = 1  # this claim included
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    tries: dict[int, set[int]] = field(default_factory=dict)  # line -> claims in which it was in flight
    suspects: set[int] | None = None  # lines to decode one at a time; None: any line may be suspect
    idle_claims: int = 0  # claims in a row, before this one, that decided nothing


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def append(self, record: dict[str, Any]) -> bool:
        """Append one record durably. On a full or read-only disk, warn and go on: the queue then keeps
        its promises as without a journal (a restart decodes the file's undecided requests again)."""
        try:
            self.path.parent.mkdir(exist_ok=True)
            append_line(self.path, dumps(record))
        except OSError as e:
            log.warning("cannot write the journal %s: %s", self.path, e)
            return False
        return True

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def resume(self) -> JournalState:
        """Read what earlier claims decided, and record this claim."""
        st = JournalState()
        claim = 1
        progress = False
        clean = False
        tried_last: set[int] = set()
        in_flight: set[int] = set()
        any_try_last = False
        for rec in read_jsonl(self.path):
            if "claim" in rec and len(rec) == 1:
                st.idle_claims = 0 if progress else st.idle_claims + 1
                claim, progress, clean = int(rec["claim"]), False, False
                tried_last, in_flight, any_try_last = set(), set(), False
            elif "outcomes" in rec:
                for o in rec["outcomes"]:
                    st.outcomes[int(o["line"])] = o
                progress = True
            elif "try" in rec:
                any_try_last = True
                for line in rec["try"]:
                    st.tries.setdefault(int(line), set()).add(claim)
                    tried_last.add(int(line))
            elif "stopped" in rec:
                clean = True
                in_flight = {int(x) for x in rec["stopped"]}
                for line in in_flight:
                    st.tries.setdefault(line, set()).add(claim)
        st.idle_claims = 0 if progress else st.idle_claims + 1
        st.claims = claim + 1
        if clean:
            st.suspects = in_flight - set(st.outcomes)
        elif any_try_last:
            st.suspects = tried_last - set(st.outcomes)
        else:
            st.suspects = None  # died without saying what was in flight: every remaining line is suspect
        self.append({"claim": st.claims})
        return st


def try_counts(state: JournalState) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for line, claims in state.tries.items():
        counts[line] = len(claims)
    return counts
