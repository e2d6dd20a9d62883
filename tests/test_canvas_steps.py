"""`scripts/canvas_steps.py` prints the tiny DiffusionGemma checkpoint's denoising steps per second (issue 55):
the steps of one decode, counted at the model, and one wall time per timed decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = str(REPO / "scripts" / "canvas_steps.py")
    return subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=300)


def test_it_counts_the_decoder_steps_of_a_decode_and_times_each_repeat() -> None:
    p = _run("--repeat", "2")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    # 16 new tokens in canvases of 8: two canvases, each at most 48 steps (the folder's generation_config)
    assert out["new_tokens"] == 16 and 2 <= out["steps"] <= 96
    assert out["steps"] == out["forwards"] - 2  # the engine's forwards less the prompt's pass and one commit
    assert len(out["walls_s"]) == 2
    assert out["steps_per_s"] == pytest.approx(out["steps"] / min(out["walls_s"]), rel=0.01)  # walls are rounded


def test_a_repeat_outside_its_bounds_is_refused_by_name() -> None:
    p = _run("--repeat", "0")
    assert p.returncode == 2 and "--repeat 0" in p.stderr and "Traceback" not in p.stderr
