"""`scripts/gpu-train` runs end to end on CPU at a tiny shape: a block-diffusion run from a corpus folder with
the embedded block model's tokenizer, its generation settings on the export, eval figures beside the bars
in one JSON (issues #14 and #17; a real run needs a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import LINES

REPO = Path(__file__).parents[1]


def test_gpu_train_runs_end_to_end_on_cpu_at_a_tiny_shape(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("\n".join(LINES * 5) + "\n", encoding="utf-8")
    (corpus / "heldout.txt").write_text("\n".join(LINES[:6]) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "scripts" / "gpu-train"), "--device", "cpu", "--tiny", "--no-install",
           "--corpus", str(corpus), "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    report = json.loads((out / "gpu-train.json").read_text())
    assert json.loads(p.stdout) == report
    assert report["shape"]["d_model"] == 32 and report["last_step"]["step"] == 4
    assert set(report["eval"]) == set(report["bars_met"]) and len(report["eval"]) == 6
    model = out / "model"
    assert json.loads((model / "config.json").read_text())["block_causal"] is True
    shipped = REPO / "celeris_cli" / "models" / "celeris-block"
    assert (model / "generation_config.json").read_text() == (shipped / "generation_config.json").read_text()
    assert (model / "tokenizer.model").read_bytes() == (shipped / "tokenizer.model").read_bytes()
    again = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0 and json.loads(again.stdout)["last_step"] is None  # resumed: nothing left to do
