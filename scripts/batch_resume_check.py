"""Check that `celeris batch` resumes after SIGKILL: `python scripts/batch_resume_check.py [-n 8000]`.

An input of N requests with about 3% bad lines (broken JSON, no prompt, a bad setting, a poison prompt
that makes its batch raise) runs once uninterrupted, then again SIGKILLed after ~15% of it is decoded,
rerun and SIGKILLed at ~60%, rerun to the end. The resumed output must be byte-identical to the
uninterrupted one, each good request answered once and each bad line one failure record, and the three
runs together must decode no more than 1.1 times what the uninterrupted run decoded (not 1.75 times).
Then one changed input line is refused with a message naming it, and `--restart` runs the whole file
again. Prints the figures as JSON.

`run IN OUT [--die-after K] [--count-file F] [--restart]`: one `run_file` in this process with a fake
model at the backend boundary (answers depend only on their request) and a fixed clock, so two runs can
be compared byte for byte; `--die-after K`: SIGKILL this process in the middle of the batch that would
decode the K-th request. The crash tests use this mode as their subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.spool_helpers import FakeBackend  # noqa: E402


class CountingBackend(FakeBackend):
    """The fake model, counting what it decodes (appended to a file) and dying at the K-th request."""

    def __init__(self, die_after: int | None, count_file: str | None) -> None:
        super().__init__(fail_on="poison")
        self.die_after = die_after
        self.count_file = count_file
        self.decoded = 0

    def run(self, batch: list[Any]) -> list[dict[str, Any]]:
        if self.count_file:
            with open(self.count_file, "a") as f:
                f.write(f"{len(batch)}\n")
        self.decoded += len(batch)
        if self.die_after is not None and self.decoded >= self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-batch, as the OOM killer would
        return super().run(batch)


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="batch_resume_check.py run")
    ap.add_argument("input", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--die-after", type=int)
    ap.add_argument("--count-file")
    ap.add_argument("--restart", action="store_true")
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args(argv)
    import celeris_cli.spool.ledger as ledger
    from celeris_cli.batch import run_file
    from celeris_cli.batch.local import LocalExecutor
    from celeris_cli.errors import UsageError

    ledger.now_iso = lambda: "2026-01-01T00:00:00Z"  # failure records carry the wall clock; fix it
    failed = a.output.with_name(a.output.name + ".failed.jsonl")
    executor = LocalExecutor(CountingBackend(a.die_after, a.count_file), a.batch_size)
    try:
        report = run_file(a.input, a.output, failed, executor, None, {"fake": 1, "batch_size": a.batch_size}, a.restart)
    except UsageError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict()))
    return 0


def make_input(path: Path, n: int) -> tuple[int, int]:
    """n lines, every 33rd bad in one of four ways; returns (good, bad) counts."""
    lines, bad = [], 0
    for i in range(n):
        kind = i % 132 if i % 33 == 0 else -1
        if kind == 0:
            lines.append('{"id": "broken", "prompt": ')
        elif kind == 33:
            lines.append(json.dumps({"id": f"r{i}"}))  # no prompt
        elif kind == 66:
            lines.append(json.dumps({"id": f"r{i}", "prompt": "x", "top_q": 1}))  # unknown setting
        elif kind == 99:
            lines.append(json.dumps({"id": f"r{i}", "prompt": f"poison {i}"}))  # its batch raises
        else:
            lines.append(json.dumps({"id": f"r{i}", "prompt": f"prompt number {i} " * (1 + i % 5)}))
            continue
        bad += 1
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return n - bad, bad


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def decoded(count_file: Path) -> int:
    return sum(int(x) for x in count_file.read_text().split()) if count_file.exists() else 0


def check(n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        good, bad = make_input(d / "in.jsonl", n)
        ref = worker(str(d / "in.jsonl"), str(d / "ref.jsonl"), "--count-file", str(d / "ref-count"))
        assert ref.returncode == 0, ref.stderr
        count = d / "count"
        kills = []
        for frac in (0.15, 0.60):
            already = decoded(count)
            p = worker(str(d / "in.jsonl"), str(d / "out.jsonl"), "--die-after", str(int(n * frac) - already),
                       "--count-file", str(count))  # fmt: skip
            kills.append(p.returncode)
        last = worker(str(d / "in.jsonl"), str(d / "out.jsonl"), "--count-file", str(count))
        assert last.returncode == 0, last.stderr
        out, ref_out = (d / "out.jsonl").read_bytes(), (d / "ref.jsonl").read_bytes()
        fails = (d / "out.jsonl.failed.jsonl").read_text().replace(str(d / "out.jsonl"), "OUT")
        ref_fails = (d / "ref.jsonl.failed.jsonl").read_text().replace(str(d / "ref.jsonl"), "OUT")
        results = [json.loads(x) for x in out.splitlines()]
        records = [json.loads(x) for x in fails.splitlines()]
        figures = {
            "requests": n,
            "good": good,
            "bad_lines": bad,
            "kill_exit_codes": kills,
            "results": len(results),
            "distinct_results": len({r["custom_id"] for r in results}),
            "failure_records": len(records),
            "distinct_failure_lines": len({r["source"]["line"] for r in records}),
            "output_identical": out == ref_out,
            "failed_identical": fails == ref_fails,
            "journal_left": (d / "out.jsonl.celeris-journal").exists(),
            "decoded_over_runs": decoded(count),
            "decoded_uninterrupted": decoded(d / "ref-count"),  # poison batches are bisected: more than n
            "decoded_ratio": round(decoded(count) / decoded(d / "ref-count"), 3),
        }
        # a changed line between a kill and the rerun is refused, naming it; --restart runs it anew
        (d / "out.jsonl").unlink()
        worker(str(d / "in.jsonl"), str(d / "out.jsonl"), "--die-after", str(n // 2))
        lines = (d / "in.jsonl").read_text().splitlines()
        lines[41] = json.dumps({"id": "changed", "prompt": "a different prompt"})
        (d / "in.jsonl").write_text("\n".join(lines) + "\n")
        refused = worker(str(d / "in.jsonl"), str(d / "out.jsonl"))
        figures["changed_line_exit"] = refused.returncode
        figures["changed_line_message"] = refused.stderr.strip().splitlines()[-1] if refused.stderr else ""
        restarted = worker(str(d / "in.jsonl"), str(d / "out.jsonl"), "--restart")
        figures["restart_exit"] = restarted.returncode
        figures["restart_results"] = json.loads(restarted.stdout)["results"] if restarted.returncode == 0 else None
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    return figures


def main() -> int:
    if sys.argv[1:2] == ["run"]:
        return run(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=8000, help="requests in the input")
    figures = check(ap.parse_args().n)
    print(json.dumps(figures, indent=2))
    ok = (
        figures["output_identical"]
        and figures["failed_identical"]
        and figures["results"] == figures["distinct_results"] == figures["good"]
        and figures["failure_records"] == figures["distinct_failure_lines"] == figures["bad_lines"]
        and figures["decoded_ratio"] <= 1.1
        and figures["changed_line_exit"] == 2
        and "line 42" in figures["changed_line_message"]
        and figures["restart_exit"] == 0
        and not figures["journal_left"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
