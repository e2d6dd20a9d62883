"""The clock issue's check (issue 60): does a `celeris batch` answer depend on anything but its request?

    python scripts/clock_check.py --set '{"strategy": "spec"}' --out /tmp/clock

Builds the 3,000-request file `../shared/FINDINGS.md` describes (`{"custom_id": "rI", "prompt": P + str(I)}`,
P cycling over six openings, and a line without a prompt where I % 97 == 13), then, each with the same
`--set`:

1. two uninterrupted runs of `celeris batch` (the default batch size), compared answer by answer (text,
   finish reason, error: the timing fields differ by nature);
2. 33 of its requests decoded alone (`--batch-size 1`: the three FINDINGS named, r1160, and 29 spread over
   the file), each compared with its answer in the first run;
3. a run SIGKILLed twice (`--kill-after` seconds after each start, by default a third of the first run's
   time) and resumed by the same command, compared with the first run.

Prints one JSON object, and exits 1 when any answer differs. The runs take a few minutes each on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OPENINGS = ["床前明月光，", "春眠不觉晓，", "白日依山尽，", "The jury said it", "To be, or not", "红豆生南国，"]
NAMED = [1928, 2013, 2466, 1160]


def write_requests(path: Path, n: int) -> list[dict[str, Any]]:
    lines = [
        {"custom_id": f"bad{i}"} if i % 97 == 13 else {"custom_id": f"r{i}", "prompt": OPENINGS[i % 6] + str(i)}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8")
    return lines


def batch(inp: Path, out: Path, settings: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "celeris_cli", "batch", "-i", str(inp), "-o", str(out), "--set", settings, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{out}.log", "ab"))  # noqa: SIM115


def run(inp: Path, out: Path, settings: str, *extra: str) -> float:
    t0 = time.monotonic()
    code = batch(inp, out, settings, *extra).wait()
    if code not in (0, 1):  # 1: some lines failed (the bad lines do)
        raise SystemExit(f"celeris batch exited {code}: see {out}.log")
    return round(time.monotonic() - t0, 1)


def answers(path: Path) -> dict[str, tuple[Any, ...]]:
    got = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        body = (r.get("response") or {}).get("body") or {}
        got[r["custom_id"]] = (body.get("text"), body.get("finish_reason"), r.get("error"))
    return got


def differ(a: dict[str, Any], b: dict[str, Any], ids: list[str] | None = None) -> list[str]:
    return [k for k in (ids if ids is not None else list(a)) if a.get(k) != b.get(k)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="{}", help="settings for every request, as JSON")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--kill-after", type=float, default=None, help="seconds (default: a third of run A's)")
    ap.add_argument("--out", type=Path, required=True, help="a folder for the files (created)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    inp = args.out / "in.jsonl"
    lines = write_requests(inp, args.requests)
    report: dict[str, Any] = {"requests": args.requests, "settings": json.loads(args.set)}
    a, b = args.out / "A.jsonl", args.out / "B.jsonl"
    report["seconds"] = {"A": run(inp, a, args.set, "--restart"), "B": run(inp, b, args.set, "--restart")}
    got_a = answers(a)
    report["answered"] = len(got_a)
    report["A_vs_B"] = differ(got_a, answers(b))

    picked = [i for i in NAMED if i < args.requests] + [i for i in range(7, args.requests, 104)][:29]
    alone_in = args.out / "alone.jsonl"
    alone_in.write_text("".join(json.dumps(lines[i], ensure_ascii=False) + "\n" for i in picked), encoding="utf-8")
    alone = args.out / "alone.out.jsonl"
    report["seconds"]["alone"] = run(alone_in, alone, args.set, "--batch-size", "1", "--restart")
    got_alone = answers(alone)
    report["alone"] = len(got_alone)
    report["alone_vs_A"] = differ(got_alone, got_a)

    killed = args.out / "K.jsonl"
    after = args.kill_after if args.kill_after is not None else round(report["seconds"]["A"] / 3, 1)
    report["kills"] = 0
    t0 = time.monotonic()
    for n, extra in enumerate((("--restart",), (), ())):
        p = batch(inp, killed, args.set, *extra)
        try:
            code = p.wait(timeout=after if n < 2 else None)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            report["kills"] += 1
            continue
        if code not in (0, 1):
            raise SystemExit(f"the resumed run exited {code}: see {killed}.log")
        break  # finished (a finished file is not run again)
    report["killed_after_s"] = after
    report["seconds"]["killed"] = round(time.monotonic() - t0, 1)
    report["killed_vs_A"] = differ(got_a, answers(killed))
    print(json.dumps(report, ensure_ascii=False))
    bad = report["A_vs_B"] or report["alone_vs_A"] or report["killed_vs_A"] or report["kills"] < 2
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
