"""How much a few SIGKILLs of `celeris watch` cost a batch, and where the time goes (issue 56, item 5).

    python scripts/kill_recovery.py --lines 100 --kills 5 --set '{"strategy": "spec", "gen_length": 128}'

Two runs of the same file, each in a fresh queue made from configs/batch.yaml: a clean one (`celeris watch
CONFIG --once`, timed from the spawn to its exit) and one whose daemon is SIGKILLed `--kills` times and
restarted at once (`--once` again). The kills are spread over the clean run's duration: the k-th falls at
k/(kills+1) of it, counted on the killed run's own clock, and never sooner than `--min-life` seconds after
the latest start (a daemon killed while it loads makes no progress a user would see). Printed, one JSON
object: both wall times and their ratio; per life of the killed daemon, when it started, when its first
batch was submitted (the restart's cost: Python, torch, the model, reading the journals) and how many
requests its journals held decided by then; and whether the two results files give every request the same
answer (the texts: rule 2 says a kill may not change one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["床前明月光，", "春眠不觉晓，", "The jury said it", "To be, or not", "白日依山尽，", "Shall I compare thee"]


def make_queue(root: Path, lines: int, settings: dict[str, Any]) -> Path:
    """A queue under root from the shipped config, with the request file dropped in its inbox."""
    (root / "configs").mkdir(parents=True)
    cfg = root / "configs" / "batch.yaml"
    shutil.copy(REPO / "configs" / "batch.yaml", cfg)
    inbox = root / "batch_inputs"
    inbox.mkdir()
    staged = root / "requests.jsonl"
    with staged.open("w", encoding="utf-8") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": PROMPTS[i % len(PROMPTS)] + str(i), **settings}) + "\n")
    os.rename(staged, inbox / "requests.jsonl")  # published by rename, as users do
    return cfg


def spawn(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "celeris_cli", "watch", str(cfg), "--once"],
        cwd=cfg.parent.parent,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def events(root: Path) -> list[dict[str, Any]]:
    path = root / "logs" / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def answers(root: Path) -> dict[str, Any]:
    files = list((root / "batch_outputs").glob("*.results.jsonl"))
    got: dict[str, Any] = {}
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            body = (r.get("response") or {}).get("body") or {}
            got[r["custom_id"]] = (body.get("text"), body.get("finish_reason"), r.get("error"))
    return got


def clean_run(root: Path, cfg: Path) -> float:
    t0 = time.monotonic()
    p = spawn(cfg, root / "daemon.log")
    if p.wait() != 0:
        raise SystemExit(f"the clean run exited {p.returncode}; see {root / 'daemon.log'}")
    return time.monotonic() - t0


Life = dict[str, Any]


def killed_run(root: Path, cfg: Path, kills: int, clean_s: float, min_life: float) -> tuple[float, list[Life]]:
    t0 = time.monotonic()
    lives: list[Life] = []
    for k in range(1, kills + 2):
        started, started_wall = time.monotonic(), time.time()
        seen = len(events(root))
        p = spawn(cfg, root / "daemon.log")
        life: dict[str, Any] = {"started_s": round(started - t0, 2)}
        lives.append(life)
        if k <= kills:
            due = max(t0 + clean_s * k / (kills + 1), started + min_life)
            while time.monotonic() < due and p.poll() is None:
                time.sleep(0.05)
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
                life["killed_s"] = round(time.monotonic() - t0, 2)
            else:
                life["exited"] = p.returncode
        else:
            p.wait()
            life["exited"] = p.returncode
        mine = events(root)[seen:]
        first = next((e for e in mine if e.get("event") == "submit"), None)
        life["submits"] = sum(1 for e in mine if e.get("event") == "submit")
        if first is not None:
            life["first_submit_after_s"] = round(_secs(first["time"]) - started_wall, 2)
        if "exited" in life:
            break
    return time.monotonic() - t0, lives


def _secs(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=100)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--set", default="{}", help="settings on every line, as JSON")
    ap.add_argument("--min-life", type=float, default=4.0)
    ap.add_argument("--keep", action="store_true", help="keep the two queues (their paths are printed)")
    args = ap.parse_args()
    settings = json.loads(args.set)
    base = Path(tempfile.mkdtemp(prefix="celeris-kills-"))
    try:
        a, b = base / "clean", base / "killed"
        clean_s = clean_run(a, make_queue(a, args.lines, settings))
        killed_s, lives = killed_run(b, make_queue(b, args.lines, settings), args.kills, clean_s, args.min_life)
        got_a, got_b = answers(a), answers(b)
        report = {
            "lines": args.lines,
            "settings": settings,
            "kills": sum(1 for life in lives if "killed_s" in life),
            "clean_s": round(clean_s, 1),
            "killed_s": round(killed_s, 1),
            "ratio": round(killed_s / clean_s, 2),
            "lives": lives,
            "answered": [len(got_a), len(got_b)],
            "same_answers": got_a == got_b,
            "differ": sorted(k for k in got_a if got_a[k] != got_b.get(k))[:10],
        }
        if args.keep:
            report["queues"] = [str(a), str(b)]
        print(json.dumps(report))
        return 0 if got_a == got_b and len(got_a) == args.lines else 1
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
