"""`celeris batch` after a crash: the journal beside the output keeps every finished batch, so a rerun
decodes only the rest and publishes the same bytes as an uninterrupted run; a changed input or changed
settings are refused by name, and `--restart` starts over. Real subprocesses, killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from celeris_cli.batch import Outcome
from celeris_cli.batch.ray_pool import BatchGather
from celeris_cli.spool.backend import Prepared
from celeris_cli.spool.formats import Request
from celeris_cli.spool.fsutil import CRASH_ENV, CRASH_EXIT

from .test_batch import celeris

REPO = Path(__file__).parents[1]
SCRIPT = REPO / "scripts" / "batch_resume_check.py"
sys.path.insert(0, str(REPO / "scripts"))
from batch_resume_check import make_input  # noqa: E402


def worker(inp: Path, out: Path, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    """One `run_file` with the fake model in a subprocess (the check script's `run` mode)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), CRASH_ENV: crash_at or ""}
    return subprocess.run([sys.executable, str(SCRIPT), "run", str(inp), str(out), *args], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def decoded(count: Path) -> int:
    return sum(int(x) for x in count.read_text().split()) if count.exists() else 0


@pytest.fixture
def reference(tmp_path: Path) -> tuple[Path, bytes, bytes, int]:
    """An input of 400 lines (13 bad) and the bytes of its uninterrupted run's two files."""
    make_input(tmp_path / "in.jsonl", 400)
    p = worker(tmp_path / "in.jsonl", tmp_path / "ref.jsonl", "--count-file", str(tmp_path / "ref-count"))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed"] == 0  # its bad lines are journaled, but nothing was resumed
    ref = (tmp_path / "ref.jsonl").resolve()
    fails = (tmp_path / "ref.jsonl.failed.jsonl").read_bytes().replace(bytes(ref), b"OUT")
    return tmp_path / "in.jsonl", (tmp_path / "ref.jsonl").read_bytes(), fails, decoded(tmp_path / "ref-count")


@pytest.mark.parametrize(
    "point",
    [
        "mid-batch",  # SIGKILL inside the decoding of the batch holding the 200th request
        "batch-journaled",  # just after the first batch's journal line is fsynced
        "failed-written",  # the failures file published, the results not yet
        "output-staged",  # the results fsynced under a temp name, not yet renamed
        "output-written",  # the results published, the journal not yet removed
    ],
)
def test_a_rerun_after_a_kill_publishes_the_bytes_of_an_uninterrupted_run(
    tmp_path: Path, reference: tuple[Path, bytes, bytes, int], point: str
) -> None:
    inp, ref_out, ref_fails, ref_decoded = reference
    out, count = tmp_path / "out.jsonl", tmp_path / "count"
    journal = tmp_path / "out.jsonl.celeris-journal"
    if point == "mid-batch":
        p = worker(inp, out, "--die-after", "200", "--count-file", str(count))
        assert p.returncode == -9, p.stderr
        assert not out.exists()  # the output appears whole at the end, or not at all
        finished = [r for rec in map(json.loads, journal.open()) for r in rec.get("results", [])]
        assert 100 < len(finished) < 200  # progress is readable in the journal, in the results' shape
        ref_lines = set(ref_out.splitlines())  # batches finish in cost order; each line is final already
        assert all(json.dumps(r, ensure_ascii=False).encode() in ref_lines for r in finished)
    else:
        p = worker(inp, out, "--count-file", str(count), crash_at=point)
        assert p.returncode == CRASH_EXIT, p.stderr
    assert journal.exists()
    first = decoded(count)
    p = worker(inp, out, "--count-file", str(count))
    assert p.returncode == 0, p.stderr
    assert out.read_bytes() == ref_out
    assert (tmp_path / "out.jsonl.failed.jsonl").read_bytes().replace(bytes(out.resolve()), b"OUT") == ref_fails
    assert not journal.exists() and not list(tmp_path.glob(".*.tmp"))
    rerun = decoded(count) - first
    assert first + rerun <= ref_decoded + 16  # at most the one batch the kill cut short is decoded twice
    if point != "mid-batch" and point != "batch-journaled":
        assert rerun == 0  # everything was journaled: the rerun only publishes


def test_a_changed_line_is_refused_by_number_and_restart_starts_over(
    tmp_path: Path, reference: tuple[Path, bytes, bytes, int]
) -> None:
    inp, ref_out, _, _ = reference
    out = tmp_path / "out.jsonl"
    assert worker(inp, out, "--die-after", "200").returncode == -9
    lines = inp.read_text().splitlines()
    lines[41] = json.dumps({"id": "r41", "prompt": "changed"})
    inp.write_text("\n".join(lines) + "\n")
    p = worker(inp, out)
    assert p.returncode == 2 and "changed since the interrupted run: line 42 differs" in p.stderr
    assert "--restart" in p.stderr and "Traceback" not in p.stderr and not out.exists()
    p = worker(inp, out, "--restart")
    assert p.returncode == 0, p.stderr
    assert out.read_bytes() != ref_out and b'"changed"' not in ref_out and b"degnahc" in out.read_bytes()
    assert not (tmp_path / "out.jsonl.celeris-journal").exists()


def test_the_cli_resumes_with_the_same_settings_and_refuses_changed_ones(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "in.txt").write_text("".join(f"prompt {i} " * (1 + i % 3) + "\n" for i in range(12)))
    common = ["batch", "-i", str(tmp_path / "in.txt"), "--model", str(tiny_model), "--device", "cpu", "--dtype",
              "float32", "--batch-size", "4", "--set", '{"denoise_steps": 4, "gen_length": 8}']  # fmt: skip
    assert celeris(*common, "-o", str(tmp_path / "ref.jsonl")).returncode == 0
    out = str(tmp_path / "out.jsonl")
    p = celeris(*common, "-o", out, env={CRASH_ENV: "batch-journaled"})
    assert p.returncode == CRASH_EXIT and (tmp_path / "out.jsonl.celeris-journal").exists()
    changed = [*common[:-1], '{"denoise_steps": 8, "gen_length": 8}']
    p = celeris(*changed, "-o", out)
    assert p.returncode == 2 and "the settings changed since the interrupted run (generation:" in p.stderr
    assert "Traceback" not in p.stderr
    p = celeris(*common[:-4], "--batch-size", "6", *common[-2:], "-o", out)
    assert p.returncode == 2 and "batch_size: 4 -> 6" in p.stderr
    p = celeris(*common, "-o", out)
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("resumed: 4 requests were finished by an interrupted run\n"), p.stderr  # said first

    def answers(path: Path) -> list[tuple[str, str]]:
        return [(r["custom_id"], r["response"]["body"]["text"]) for r in map(json.loads, path.open())]

    assert answers(tmp_path / "out.jsonl") == answers(tmp_path / "ref.jsonl")  # bodies carry timings
    assert not (tmp_path / "out.jsonl.celeris-journal").exists()


def test_ray_rows_are_journaled_by_whole_packed_batch() -> None:
    """The Ray driver gets rows one by one, batches interleaved; it hands a batch on only when whole."""
    reqs = [Request(f"r{i}", i, prompt="p") for i in range(1, 6)]
    gather = BatchGather([[Prepared(r, None, 1) for r in reqs[:3]], [Prepared(r, None, 1) for r in reqs[3:]]])
    got = [gather.add(Outcome(reqs[i], body={})) for i in (0, 3, 1, 4, 2)]
    assert got[:3] == [None, None, None]
    assert [o.request.line for o in got[3] or []] == [4, 5] and [o.request.line for o in got[4] or []] == [1, 2, 3]


def test_ctrl_c_keeps_finished_batches_and_exits_130(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "in.txt").write_text("".join(f"prompt {i}\n" for i in range(400)))
    out = tmp_path / "out.jsonl"
    journal = tmp_path / "out.jsonl.celeris-journal"
    settings = '{"denoise_steps": 4, "gen_length": 8}'
    cmd = [sys.executable, "-m", "celeris_cli", "batch", "-i", str(tmp_path / "in.txt"), "-o", str(out), "--model",
           str(tiny_model), "--device", "cpu", "--batch-size", "2", "--set", settings]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal, whatever the runner left (a SIGINT ignored here is ignored by the child too)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not (journal.exists() and len(journal.read_bytes().splitlines()) >= 3):  # key and two batches
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 130 and "run the same command again to resume" in err and "Traceback" not in err
    assert not out.exists() and len(journal.read_bytes().splitlines()) >= 3
