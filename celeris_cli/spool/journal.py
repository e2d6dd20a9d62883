"""The journal of one claimed file: what is decided about its requests, kept across stops and crashes.

`inputs/.work/journal/<claim>.jsonl`, appended and fsynced, one JSON object a line:
- `{"claim": n, "boot": id}`: the file was resumed (claim n, on that boot of the machine; the first claim
  writes nothing);
- `{"try": [lines]}`: these lines are about to be decoded; `"suspect": true` when it is a suspects' test
  (suspect lines of one group decoded together, nothing else in flight);
- `{"outcomes": [{"line", "body"} | {"line", "failure"}]}`: a finished batch, decided once for good;
- `{"prepared": true}`: a resumed claim's requests are read and prepared (it waits for its turn);
- `{"stopped": [lines]}`: a clean stop (SIGTERM, SIGINT, grace expired), with the lines that were in flight.

On resume, decided lines are never decoded again. What ended each earlier claim is read from the journal:
a stop (a `stopped` record) or a machine restart (the next claim has another boot id) says nothing about
a request; a death (no `stopped` record, same boot) does. After a death the lines it had in flight are
suspects, one group, tested together with nothing else in flight (`groups`): a group whose test ends is
decided, as any batch, so a daemon killed for reasons of its own (an operator, the OOM killer) resumes at
its full pace; a group whose test died is halved, and a suspect that was being tested alone when the
process died has one more piece of evidence against it (`evidence`): `poison` decides at `max_claims` of
them. So a request that kills the process whenever it is decoded is found after about `log2(rows in
flight) + max_claims + 1` deaths, and an ordinary kill costs one batch decoded again. A
resumed claim that died with none of its lines in flight was waiting for its turn: no evidence either,
unless it died before its requests were prepared (reading or preparing them killed the process).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fsutil import append_line
from .ledger import dumps, read_jsonl

log = logging.getLogger(__name__)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This boot of the machine (Linux); None where the system does not say."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


@dataclass
class JournalState:
    claims: int = 1  # this claim included
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    evidence: dict[int, int] = field(default_factory=dict)  # line -> deaths while it was tested alone
    suspects: set[int] | None = field(default_factory=set)  # lines to test in groups; None: every line, one group
    groups: list[set[int]] = field(default_factory=list)  # the suspects' groups, in the order to test them
    idle_deaths: int = 0  # resumed claims in a row that died reading or preparing the file


@dataclass
class _Claim:
    """What one earlier claim left in the journal."""

    boot: str | None = None
    tried: set[int] = field(default_factory=set)
    tested: set[int] = field(default_factory=set)  # lines of suspect tests
    test: set[int] = field(default_factory=set)  # the lines of its last suspects' test (in flight at a death)
    any_try: bool = False
    prepared: bool = False
    stopped: bool = False
    progress: bool = False


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

    def resume(self, boot: str | None = None) -> JournalState:
        """Read what earlier claims decided and what ended each of them, and record this claim (on
        `boot`, this machine's boot id by default)."""
        boot = boot_id() if boot is None else boot
        st = JournalState()
        number = 1
        claims = [_Claim()]
        for rec in read_jsonl(self.path):
            if "claim" in rec and not ({"try", "outcomes", "stopped"} & rec.keys()):
                number = int(rec["claim"])
                claims.append(_Claim(boot=rec.get("boot")))
            elif "outcomes" in rec:
                for o in rec["outcomes"]:
                    st.outcomes[int(o["line"])] = o
                claims[-1].progress = True
            elif "try" in rec:
                lines = {int(line) for line in rec["try"]}
                claims[-1].any_try = True
                claims[-1].tried |= lines
                if rec.get("suspect") is True:
                    claims[-1].tested |= lines
                    claims[-1].test = lines
            elif "stopped" in rec:
                claims[-1].stopped = True
            elif "prepared" in rec:
                claims[-1].prepared = True
        for i, claim in enumerate(claims):
            after = claims[i + 1].boot if i + 1 < len(claims) else boot
            restarted = claim.boot is not None and after is not None and claim.boot != after
            if claim.stopped or restarted:
                continue  # a stop or a restart: no evidence, and the suspects stay what they were
            decided = set(st.outcomes)
            in_test = claim.test - decided  # the test in flight at the death (one runs at a time)
            if len(in_test) == 1:  # tested alone: evidence against it
                (line,) = in_test
                st.evidence[line] = st.evidence.get(line, 0) + 1
            if claim.any_try:
                kept = [g - in_test for g in (st.groups if st.suspects is not None else [])]
                ordered = sorted(in_test)
                halves = [set(ordered[: len(ordered) // 2]), set(ordered[len(ordered) // 2 :])]
                others = claim.tried - claim.tested - decided - set().union(*kept)  # ordinary rows in flight
                st.groups = [g for g in [*halves, *kept, others] if g]
                st.suspects = claim.tried | (st.suspects or set())
            elif i == 0:  # a first claim journals nothing for a file decoded in one batch: it may have been
                st.suspects = None  # in flight; every remaining line is suspect
            elif not claim.prepared and not claim.progress:
                st.idle_deaths += 1  # died reading or preparing this file
                continue
            st.idle_deaths = 0 if claim.any_try or claim.progress else st.idle_deaths
        if st.suspects is not None:
            st.suspects -= set(st.outcomes)
            grouped = [g & st.suspects for g in st.groups]
            rest = st.suspects - set().union(*grouped)  # suspects no group holds: one group of their own
            st.groups = [g for g in [*grouped, rest] if g]
        else:
            st.groups = []
        st.claims = number + 1
        self.append({"claim": st.claims, **({"boot": boot} if boot else {})})
        return st
