"""Soak the queue as users' scripts drive it, with faults, and reconcile: `python scripts/soak.py soak`.

The daemon is the real Spool in a subprocess (`tests.run_spool`, a fake model at the backend boundary).
A producer publishes prompt files by rename (3% bad lines, some names reused while the earlier file of
that name is claimed or processed, one poison line that SIGKILLs the daemon whenever it is decoded) and
one appender writes a file line by line through an open handle across the claim; a killer SIGKILLs the
daemon at random. Every prompt and bad line carries a unique token, so reconciliation is by token: each
must appear in exactly one result or one failure record, and the poison line in one `poison` record.

`resume`: a file of N lines, SIGTERM when half is decoded, restart; reports decoded/lines.
`claims`: N one-line files through `watch --once` in-process; reports the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.spool_helpers import claimed, failures, make_queue, outputs  # noqa: E402

POISON = "POISON"


def spawn(config: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CELERIS_CRASH_AT", None)
    cmd = [sys.executable, "-m", "tests.run_spool", str(config), *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def publish(inbox: Path, name: str, text: str, fallback: str | None = None) -> None:
    """Publish by rename; a reused name is published only when no unclaimed file of that name waits in
    the inbox (a rename over it would destroy it before the queue saw it), else under `fallback`."""
    tmp = inbox / f".{name}.{random.random():.9f}.part"
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
    def __init__(self, inbox: Path, prompts: int, seed: int) -> None:
        self.inbox = inbox
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.tokens: set[str] = set()
        self.bad: set[str] = set()
        self.n = 0
        self.done = threading.Event()

    def token(self) -> str:
        self.n += 1
        return f"u{self.n:06d}"

    def line(self, jsonl: bool) -> str:
        t = self.token()
        if jsonl and self.rng.random() < 0.05:  # about 3% of all lines: invalid JSON or no prompt
            self.bad.add(t)
            return f'{{"id": "{t}", "prompt": broken {t}' if self.rng.random() < 0.5 else f'{{"id": "{t}"}}'
        self.tokens.add(t)
        return json.dumps({"id": t, "prompt": f"{t} says hello"}) if jsonl else f"{t} says hello"

    def run(self, poison_at: int) -> None:
        made = 0
        files = 0
        while made < self.prompts:
            files += 1
            k = self.rng.randint(1, 14)
            jsonl = self.rng.random() < 0.6
            lines = [self.line(jsonl) for _ in range(k)]
            if made <= poison_at < made + k:
                t = self.token()
                self.poison = t
                lines.append(json.dumps({"id": t, "prompt": f"{t} {POISON}"}) if jsonl else f"{t} {POISON}")
            made += k
            suffix = ".jsonl" if jsonl else ".txt"
            unique = f"f{files:05d}{suffix}"
            if self.rng.random() < 0.1:  # a reused name, while the earlier file of that name is claimed or done
                publish(self.inbox, f"daily{suffix}", "\n".join(lines) + "\n", fallback=unique)
            else:
                publish(self.inbox, unique, "\n".join(lines) + "\n")
            time.sleep(self.rng.uniform(0.02, 0.15))
        self.done.set()

    def append_slowly(self, lines: int) -> None:
        """One writer that appends through an open handle, one line at a time, across the claim."""
        with open(self.inbox / "appender.txt", "a", encoding="utf-8") as f:
            for _ in range(lines):
                t = self.token()
                self.tokens.add(t)
                f.write(f"{t} appended\n")
                f.flush()
                time.sleep(0.15)


def soak(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="celeris-soak-"))
    config = make_queue(root, batch_size=8, settle_s=0.5, rescan_s=0.2, max_claims=2, shutdown_grace_s=1)
    rng = random.Random(args.seed)
    prod = Producer(root / "batch_inputs", args.prompts, args.seed)
    poison_at = args.prompts // 2
    t0 = time.monotonic()
    producer = threading.Thread(target=prod.run, args=(poison_at,))
    appender = threading.Thread(target=prod.append_slowly, args=(40,))
    producer.start()
    appender.start()
    kills = 0
    daemon_args = ("--delay", "0.005", "--die-on", POISON)
    while not prod.done.is_set() or appender.is_alive():
        p = spawn(config, *daemon_args)
        time.sleep(rng.uniform(0.5, args.max_life_s))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()
        kills += p.returncode == -signal.SIGKILL
    producer.join()
    appender.join()
    for _ in range(20):  # drain: the poison line kills the daemon until it is quarantined
        p = spawn(config, "--once", *daemon_args)
        p.wait()
        kills += p.returncode == -signal.SIGKILL
        if (
            p.returncode in (0, 1)
            and not claimed(root)
            and not any(e.is_file() and not e.name.startswith(".") for e in (root / "batch_inputs").iterdir())
        ):
            break
    wall = time.monotonic() - t0

    seen: dict[str, int] = {}
    for recs in outputs(root).values():
        for rec in recs:
            t = rec["response"]["body"]["text"][::-1].split()[0]
            seen[t] = seen.get(t, 0) + 1
    poison_codes = []
    for rec in failures(root):
        blob = json.dumps(rec.get("request"), ensure_ascii=False)
        toks = [w.strip('"{},:') for w in blob.replace("\\", " ").split() if w.strip('"{},:').startswith("u")]
        toks = [t for t in toks if len(t) == 7 and t[1:].isdigit()]
        if not toks:
            print("record without a token:", rec)
            continue
        seen[toks[0]] = seen.get(toks[0], 0) + 1
        if toks[0] == prod.poison:
            poison_codes.append(rec["code"])
    expected = prod.tokens | prod.bad | {prod.poison}
    lost = sorted(expected - set(seen))
    dup = sorted(t for t, n in seen.items() if n > 1)
    extra = sorted(set(seen) - expected)
    bad_ok = all(seen.get(t) == 1 for t in prod.bad)
    report = {
        "prompts": len(expected),
        "bad_lines": len(prod.bad),
        "sigkills": kills,
        "wall_s": round(wall, 1),
        "lost": len(lost),
        "duplicated": len(dup),
        "unexpected": len(extra),
        "bad_lines_one_record_each": bad_ok,
        "poison_record": poison_codes,
        "root": str(root),
    }
    print(json.dumps(report))
    ok = not lost and not dup and not extra and bad_ok and poison_codes == ["poison"]
    return 0 if ok else 1


def resume(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="celeris-resume-"))
    config = make_queue(root, batch_size=args.batch_size, shutdown_grace_s=5)
    n = args.lines
    publish(root / "batch_inputs", "big.txt", "".join(f"prompt {i}\n" for i in range(n)))
    os.utime(root / "batch_inputs" / "big.txt", (1, 1))
    count = root / "decoded.txt"
    t0 = time.monotonic()
    p = spawn(config, "--delay", str(args.delay), "--count-file", str(count))
    while not count.exists() or sum(1 for _ in open(count)) < n // 2:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.wait()
    at_stop = sum(1 for _ in open(count))
    q = spawn(config, "--once", "--delay", str(args.delay), "--count-file", str(count))
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
    s = sub.add_parser("soak")
    s.add_argument("--prompts", type=int, default=2000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-life-s", type=float, default=3.0, help="a daemon lives 0.5 s to this, then SIGKILL")
    r = sub.add_parser("resume")
    r.add_argument("--lines", type=int, default=50_000)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--delay", type=float, default=0.005, help="seconds per batch of the fake model")
    c = sub.add_parser("claims")
    c.add_argument("--files", type=int, default=10_000)
    args = ap.parse_args()
    return {"soak": soak, "resume": resume, "claims": claims}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
