"""Soak the queue as users' scripts drive it, with faults, and reconcile: `python scripts/soak.py soak`,
or every fault kind on its own and all mixed, as a table: `python scripts/soak.py matrix`.

The daemon is the real Spool in a subprocess (`tests.run_spool`, a fake model at the backend boundary).
A producer publishes prompt files by rename (3% bad lines); the fault kinds (`KINDS`) add: a killer that
SIGKILLs the daemon at random, one poison line that SIGKILLs it whenever it is decoded, names reused
while the earlier file of that name is claimed or processed, an appender that writes a file line by line
across the claim, one that pauses longer than settle_s after the claim (its late lines get
changed_after_claim records), names with a newline, names of 251 bytes, names that look like the queue's
own `~N` renames, short os.write counts in the daemon, the inbox deleted under a running daemon, and two
`celeris retry` at the same instant at the end (their resubmissions served). Every prompt and bad line
carries a unique token, so reconciliation is by token: each must appear in exactly one result or one
failure record (a record superseded by the result of its retry counts once), the poison line in one
`poison` record. Tracebacks are counted in every daemon's and retry's stderr.

`resume`: a file of N lines, SIGTERM when half is decoded, restart; reports decoded/lines.
`claims`: N one-line files through `watch --once` in-process; reports the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.spool_helpers import claimed, failures, make_queue, outputs  # noqa: E402

POISON = "POISON"
FLAKY = "FLAKY"  # fails (a retryable engine error) until `retry` runs it again after the fault is gone
SETTLE_S = 0.5
KINDS = (
    "sigkill",
    "poison",
    "reused_names",
    "appender",
    "slow_appender",
    "newline_names",
    "long_names",
    "lookalike_names",
    "short_writes",
    "deleted_inbox",
    "concurrent_retry",
)
SOAK_KINDS = ("sigkill", "poison", "reused_names", "appender")  # the classic soak


def spawn(config: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CELERIS_CRASH_AT", None)
    cmd = [sys.executable, "-m", "tests.run_spool", str(config), *args]
    with open(log, "ab") as err:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)


def publish(inbox: Path, name: str, text: str, fallback: str | None = None) -> None:
    """Publish by rename; a reused name is published only when no unclaimed file of that name waits in
    the inbox (a rename over it would destroy it before the queue saw it), else under `fallback`."""
    inbox.mkdir(exist_ok=True)  # it may have been deleted (the deleted_inbox fault)
    tmp = inbox / f".p{random.random():.12f}.part"
    tmp.write_text(text, encoding="utf-8")
    if fallback is None:
        os.rename(tmp, inbox / name)
        return
    try:
        os.link(tmp, inbox / name)  # no-clobber
    except FileExistsError:
        os.link(tmp, inbox / fallback)
    os.unlink(tmp)


class Producer:
    def __init__(self, inbox: Path, prompts: int, seed: int, kinds: set[str]) -> None:
        self.inbox = inbox
        self.prompts = prompts
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.tokens: set[str] = set()
        self.bad: set[str] = set()
        self.poison = ""
        self.n = 0
        self.files = 0  # across waves, so unique names stay unique
        self.done = threading.Event()
        self.gate = threading.Lock()  # publishing and deleting the inbox never overlap
        self.lock = threading.Lock()

    def token(self) -> str:
        with self.lock:
            self.n += 1
            return f"u{self.n:06d}"

    def line(self, jsonl: bool) -> str:
        t = self.token()
        if jsonl and self.rng.random() < 0.05:  # about 3% of all lines: invalid JSON or no prompt
            self.bad.add(t)
            return f'{{"id": "{t}", "prompt": broken {t}' if self.rng.random() < 0.5 else f'{{"id": "{t}"}}'
        self.tokens.add(t)
        text = f"{t} says hello" + (
            f" {FLAKY}" if "concurrent_retry" in self.kinds and self.rng.random() < 0.03 else ""
        )
        return json.dumps({"id": t, "prompt": text}) if jsonl else text

    def name(self, files: int, suffix: str) -> tuple[str, str | None]:
        """A file name, and the unique fallback for a name that may be waiting in the inbox already."""
        unique = f"f{files:05d}{suffix}"
        r = self.rng.random()
        if "reused_names" in self.kinds and r < 0.08:
            return f"daily{suffix}", unique
        if "newline_names" in self.kinds and 0.08 <= r < 0.16:
            return f"f{files:05d}\nnl{suffix}", None
        if "long_names" in self.kinds and 0.16 <= r < 0.24:
            return "L" * (251 - len(unique)) + unique, None
        if "lookalike_names" in self.kinds and 0.24 <= r < 0.32:
            return f"daily~{self.rng.randint(1, 300)}{suffix}", unique  # the queue's own rename style
        return unique, None

    def run(self, poison_at: int) -> None:
        made = 0
        while made < self.prompts:
            self.files += 1
            files = self.files
            k = self.rng.randint(1, 14)
            jsonl = self.rng.random() < 0.6
            lines = [self.line(jsonl) for _ in range(k)]
            if "poison" in self.kinds and made <= poison_at < made + k:
                t = self.token()
                self.poison = t
                lines.append(json.dumps({"id": t, "prompt": f"{t} {POISON}"}) if jsonl else f"{t} {POISON}")
            made += k
            name, fallback = self.name(files, ".jsonl" if jsonl else ".txt")
            with self.gate:
                publish(self.inbox, name, "\n".join(lines) + "\n", fallback)
            time.sleep(self.rng.uniform(0.02, 0.15))
        self.done.set()

    def append_slowly(self, lines: int) -> None:
        """One writer that appends through an open handle, one line at a time, across the claim."""
        with self.gate:
            self.inbox.mkdir(exist_ok=True)
            f = open(self.inbox / "appender.txt", "a", encoding="utf-8")
        with f:
            for _ in range(lines):
                t = self.token()
                self.tokens.add(t)
                f.write(f"{t} appended\n")
                f.flush()
                time.sleep(0.15)

    def append_with_pauses(self, files: int, lines: int) -> None:
        """Writers that pause longer than settle_s once their file is claimed, then go on appending."""
        for i in range(files):
            path = self.inbox / f"slow{i}.txt"
            with self.gate:
                self.inbox.mkdir(exist_ok=True)
                f = open(path, "a", encoding="utf-8")
            with f:
                for j in range(lines):
                    t = self.token()
                    self.tokens.add(t)
                    f.write(f"{t} paused\n")
                    f.flush()
                    if j == lines // 2:
                        deadline = time.monotonic() + 20
                        while path.exists() and time.monotonic() < deadline:
                            time.sleep(0.05)  # until claimed
                        time.sleep(3 * SETTLE_S)  # longer than settle_s: it may well be published by now


def _waiting(inbox: Path) -> bool:
    return inbox.is_dir() and any(e.is_file() and not e.name.startswith(".") for e in inbox.iterdir())


def _drain(root: Path, config: Path, logs: Path, daemon_args: tuple[str, ...]) -> int:
    kills = 0
    for _ in range(20):  # the poison line kills the daemon until it is quarantined
        p = spawn(config, logs / f"drain-{time.monotonic_ns()}.err", "--once", *daemon_args)
        p.wait()
        kills += p.returncode == -signal.SIGKILL
        if p.returncode in (0, 1) and not claimed(root) and not _waiting(root / "batch_inputs"):
            break
    return kills


def _retry_twice(root: Path, config: Path, logs: Path) -> int:
    """Two `celeris retry --no-run` at the same instant; returns how many requests they resubmitted."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = root / "logs" / "failed.jsonl"
    cmd = [sys.executable, "-m", "celeris_cli", "retry", str(log), "--config", str(config), "--no-run", "--json"]
    procs = []
    for i in range(2):
        with open(logs / f"retry-{i}.err", "wb") as err:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err))
    outs = [p.communicate()[0] for p in procs]
    return sum(json.loads(o)["resubmitted"] for o in outs if o.strip())


def run_case(kinds: set[str], prompts: int, seed: int, max_life_s: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="celeris-soak-"))
    logs = root / "stderr"
    logs.mkdir()
    config = make_queue(root, batch_size=8, settle_s=SETTLE_S, rescan_s=0.2, max_claims=2, shutdown_grace_s=1)
    rng = random.Random(seed)
    prod = Producer(root / "batch_inputs", prompts, seed, kinds)
    t0 = time.monotonic()
    writers = [threading.Thread(target=prod.run, args=(prompts // 2,))]
    if "appender" in kinds:
        writers.append(threading.Thread(target=prod.append_slowly, args=(40,)))
    if "slow_appender" in kinds:
        writers.append(threading.Thread(target=prod.append_with_pauses, args=(4, 10)))
    daemon_args: tuple[str, ...] = ("--delay", "0.005", "--die-on", POISON)
    if "short_writes" in kinds:
        daemon_args += ("--short-writes", "0.3")
    state = {"kills": 0, "deletions": 0}
    p = spawn(config, logs / "daemon-0.err", *daemon_args, "--fail-on", FLAKY)
    kill_at = time.monotonic() + rng.uniform(0.5, max_life_s)

    def tend() -> None:
        """One tick of the killer: SIGKILL the daemon when its time is up, start another when it died."""
        nonlocal p, kill_at
        time.sleep(0.05)
        if "sigkill" in kinds and time.monotonic() > kill_at:
            p.send_signal(signal.SIGKILL)
        if p.poll() is not None:  # killed, by us or by the poison line
            state["kills"] += p.returncode == -signal.SIGKILL
            p = spawn(config, logs / f"daemon-{time.monotonic_ns()}.err", *daemon_args, "--fail-on", FLAKY)
            kill_at = time.monotonic() + rng.uniform(0.5, max_life_s)

    inbox = root / "batch_inputs"
    waves = 3 if "deleted_inbox" in kinds else 1
    for wave in range(waves):
        if wave:  # the inbox deleted under the running daemon once it is idle, then a new wave of files
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (claimed(root) or _waiting(inbox)):
                tend()
            with prod.gate:
                shutil.rmtree(inbox, ignore_errors=True)
                state["deletions"] += 1
            time.sleep(0.5)  # the daemon rescans (and creates it again) before the next file
            prod.prompts = max(10, prompts // 4)
            writers = [threading.Thread(target=prod.run, args=(-1,))]
        for w in writers:
            w.start()
        while any(w.is_alive() for w in writers):
            tend()
    p.send_signal(signal.SIGTERM)
    p.wait()
    kills = state["kills"] + _drain(root, config, logs, (*daemon_args, "--fail-on", FLAKY))
    resubmitted = 0
    if "concurrent_retry" in kinds:
        resubmitted = _retry_twice(root, config, logs)
        kills += _drain(root, config, logs, daemon_args)
    wall = time.monotonic() - t0
    return reconcile(root, prod, kinds) | {
        "sigkills": kills,
        "inbox_deleted": state["deletions"],
        "resubmitted": resubmitted,
        "wall_s": round(wall, 1),
        "tracebacks": sum(f.read_text(errors="replace").count("Traceback") for f in logs.iterdir()),
        "root": str(root),
    }


def reconcile(root: Path, prod: Producer, kinds: set[str]) -> dict[str, Any]:
    results: dict[str, int] = {}
    for recs in outputs(root).values():
        for rec in recs:
            t = rec["response"]["body"]["text"][::-1].split()[0]
            results[t] = results.get(t, 0) + 1
    retried = {r.get("key") for r in _jsonl(root / "logs" / "retried.jsonl")}
    records: dict[str, int] = {}
    poison_codes = []
    untokened = 0
    all_recs = failures(root)
    for rec in all_recs:
        blob = json.dumps(rec.get("request"), ensure_ascii=False)
        toks = [w.strip('"{},:') for w in blob.replace("\\", " ").split() if w.strip('"{},:').startswith("u")]
        toks = [t for t in toks if len(t) == 7 and t[1:].isdigit()]
        if not toks:
            untokened += 1
            continue
        t = toks[0]
        if rec.get("key") in retried and results.get(t):
            continue  # superseded by the result of its retry
        records[t] = records.get(t, 0) + 1
        if t == prod.poison:
            poison_codes.append(rec["code"])
    expected = prod.tokens | prod.bad | ({prod.poison} if prod.poison else set())
    seen = {t: results.get(t, 0) + records.get(t, 0) for t in set(results) | set(records)}
    lost = sorted(expected - set(seen))
    return {
        "case": "+".join(sorted(kinds)) if len(kinds) < len(KINDS) else "all mixed",
        "submitted": len(expected),
        "bad_lines": len(prod.bad),
        "results": sum(results.values()),
        "failure_records": len(all_recs),
        "lost": len(lost),
        "duplicated": sum(1 for n in seen.values() if n > 1),
        "unexpected": len(set(seen) - expected) + untokened,
        "bad_lines_one_record_each": all(records.get(t) == 1 and not results.get(t) for t in prod.bad),
        "poison_record": poison_codes,
        "late_records": sum(1 for r in all_recs if r.get("code") == "changed_after_claim"),
    }


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def ok(report: dict[str, Any]) -> bool:
    poison_ok = (
        report["poison_record"] == ["poison"] if "poison" in report["case"] or report["case"] == "all mixed" else True
    )
    return (
        report["lost"] == 0
        and report["duplicated"] == 0
        and report["unexpected"] == 0
        and report["tracebacks"] == 0
        and report["bad_lines_one_record_each"]
        and poison_ok
    )


def soak(args: argparse.Namespace) -> int:
    kinds = set(KINDS) if args.kinds == "all" else set(args.kinds.split(",")) if args.kinds else set(SOAK_KINDS)
    unknown = kinds - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown fault kinds: {', '.join(sorted(unknown))} (known: {', '.join(KINDS)}, all)")
    report = run_case(kinds, args.prompts, args.seed, args.max_life_s)
    print(json.dumps(report))
    return 0 if ok(report) else 1


COLUMNS = ("case", "submitted", "results", "failure_records", "lost", "duplicated", "tracebacks", "faults_seen")


def faults_seen(r: dict[str, Any]) -> str:
    seen = {
        "SIGKILLs": r["sigkills"],
        "inbox deletions": r["inbox_deleted"],
        "late-line records": r["late_records"],
        "resubmitted": r["resubmitted"],
    }
    return ", ".join(f"{n} {what}" for what, n in seen.items() if n) or "-"


def matrix(args: argparse.Namespace) -> int:
    """Each fault kind alone (with the 3% bad lines), then all of them mixed: one table row each."""
    cases = [{k} for k in KINDS] + [set(KINDS)]
    rows = []
    for i, kinds in enumerate(cases):
        n = args.prompts if kinds == set(KINDS) else args.case_prompts
        rows.append(run_case(kinds, n, args.seed + i, args.max_life_s))
        rows[-1]["faults_seen"] = faults_seen(rows[-1])
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS]
    print("| " + " | ".join(c.replace("_", " ").ljust(w) for c, w in zip(COLUMNS, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[c]).ljust(w) for c, w in zip(COLUMNS, widths)) + " |")
    return 0 if all(ok(r) for r in rows) else 1


def resume(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="celeris-resume-"))
    config = make_queue(root, batch_size=args.batch_size, shutdown_grace_s=5)
    n = args.lines
    publish(root / "batch_inputs", "big.txt", "".join(f"prompt {i}\n" for i in range(n)))
    os.utime(root / "batch_inputs" / "big.txt", (1, 1))
    count = root / "decoded.txt"
    t0 = time.monotonic()
    p = spawn(config, root / "daemon.err", "--delay", str(args.delay), "--count-file", str(count))
    while not count.exists() or sum(1 for _ in open(count)) < n // 2:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.wait()
    at_stop = sum(1 for _ in open(count))
    q = spawn(config, root / "daemon.err", "--once", "--delay", str(args.delay), "--count-file", str(count))
    q.wait()
    decoded = sum(1 for _ in open(count))
    ids = [r["custom_id"] for r in outputs(root)["big.txt.results.jsonl"]]
    ordered = ids == [f"line-{i}" for i in range(1, n + 1)]
    report = {
        "lines": n,
        "decoded_before_sigterm": at_stop,
        "decoded_total": decoded,
        "ratio": round(decoded / n, 4),
        "one_complete_ordered_file": ordered,
        "exit_codes": [p.returncode, q.returncode],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(report))
    return 0 if ordered and decoded <= 1.05 * n else 1


def claims(args: argparse.Namespace) -> int:
    from celeris_cli.spool.config import load_config
    from celeris_cli.spool.daemon import Spool
    from tests.spool_helpers import FakeBackend

    root = Path(tempfile.mkdtemp(prefix="celeris-claims-"))
    config = make_queue(root)
    then = time.time() - 60
    for i in range(args.files):
        path = root / "batch_inputs" / f"f{i:05d}.txt"
        path.write_text(f"prompt {i}\n")
        os.utime(path, (then, then))
    t0 = time.perf_counter()
    rc = Spool(load_config(config), FakeBackend).run(once=True)
    wall = time.perf_counter() - t0
    published = len(outputs(root))
    print(json.dumps({"files": args.files, "published": published, "exit": rc, "wall_s": round(wall, 1)}))
    return 0 if published == args.files else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("soak", "matrix"):
        s = sub.add_parser(cmd)
        s.add_argument("--prompts", type=int, default=2000, help="prompts of the soak, or of the mixed case")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--max-life-s", type=float, default=3.0, help="a daemon lives about this long, then SIGKILL")
        if cmd == "soak":
            s.add_argument(
                "--kinds", default="", help="fault kinds, comma-separated, or all (default: the classic four)"
            )
        if cmd == "matrix":
            s.add_argument("--case-prompts", type=int, default=300, help="prompts of each single-kind case")
    r = sub.add_parser("resume")
    r.add_argument("--lines", type=int, default=50_000)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--delay", type=float, default=0.005, help="seconds per batch of the fake model")
    c = sub.add_parser("claims")
    c.add_argument("--files", type=int, default=10_000)
    args = ap.parse_args()
    return {"soak": soak, "matrix": matrix, "resume": resume, "claims": claims}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
