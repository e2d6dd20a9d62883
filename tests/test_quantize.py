"""`--quantize int8`: every architecture's linear layers and embedding are stored as int8 with per-row
scales, loaded tensor by tensor; the logits stay close to the float model's; an unknown scheme is refused
by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.quantize import quantize_rows
from celeris_cli.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
FOLDERS = [DATA / "llada_hf", DATA / "dream" / "dream_tiny", DATA / "llada2" / "llada2_tiny"]


def _bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_rows_round_trip_within_half_a_step_of_their_scale() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_int8_stores_every_matrix_as_int8_and_keeps_the_logits_close(folder: Path) -> None:
    full = load_model(folder, "cpu", torch.float32)
    int8 = load_model(folder, "cpu", torch.float32, "int8")
    matrices = {k for k, v in full.state_dict().items() if v.dim() == 2 and "gate.weight" not in k}
    assert {k for k, v in int8.state_dict().items() if v.dtype == torch.int8} == matrices
    assert _bytes(int8) < 0.4 * _bytes(full)
    ids = torch.arange(5, 29).view(2, 12)
    with torch.no_grad():
        a, b = full(ids), int8(ids)
    assert not torch.equal(a, b)  # the weights did change
    assert (a - b).norm() < 0.15 * a.norm()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75  # most greedy picks unchanged


def test_int8_answers_stay_close_on_the_embedded_model() -> None:
    from celeris_cli import load_engine

    prompts = ["The cat sat", "Once upon a time", "A small dog ran", "The sun", "In the morning", "We went"]
    outs = []
    for scheme in ("none", "int8"):
        engine = load_engine("celeris-block", device="cpu", dtype="float32", quantize=scheme)
        params = engine.params({"gen_length": 16, "temperature": 0})
        outs.append([r.text for r in engine.generate(prompts, params)])
    assert sum(a == b for a, b in zip(*outs)) >= len(prompts) // 2


def test_an_unknown_scheme_is_refused_by_name() -> None:
    with pytest.raises(UsageError, match="unknown quantization 'int4'"):
        load_model(FOLDERS[0], "cpu", torch.float32, "int4")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "celeris_cli", "generate", "--quantize", "int4", "-p", "x"], env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 2 and "int4" in p.stderr and "Traceback" not in p.stderr
