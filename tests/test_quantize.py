"""`--quantize int8`: every architecture's linear layers and embedding are stored as int8 with per-row
scales, loaded tensor by tensor; the logits stay close to the float model's; an unknown scheme is refused
by name. `--quantize int4`: linear layers in torch's packed int4 layout with grouped scales and zeros, the
embedding int8; the kernel computes what the dequantized weights would, a row alone as in a batch; the
planner's weights match what loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.memory import shape_of_model, weights_bytes
from celeris_cli.arch.quantize import Int4Linear, dequantize_groups, pack_int4, quantize_groups, quantize_rows
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


EMBEDDED_PROMPTS = ["The cat sat", "Once upon a time", "A small dog ran", "The sun", "In the morning", "We went"]


def _embedded_answers(scheme: str) -> list[str]:
    """The default model's greedy answers to EMBEDDED_PROMPTS with `scheme` weights."""
    from celeris_cli import load_engine

    engine = load_engine("celeris-block", device="cpu", dtype="float32", quantize=scheme)
    return [r.text for r in engine.generate(EMBEDDED_PROMPTS, engine.params({"gen_length": 16, "temperature": 0}))]


def test_int8_answers_stay_close_on_the_embedded_model() -> None:
    full, int8 = _embedded_answers("none"), _embedded_answers("int8")
    assert sum(a == b for a, b in zip(full, int8)) >= len(EMBEDDED_PROMPTS) // 2


def test_an_unknown_scheme_is_refused_by_name() -> None:
    with pytest.raises(UsageError, match="unknown quantization 'int3'"):
        load_model(FOLDERS[0], "cpu", torch.float32, "int3")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "celeris_cli", "generate", "--quantize", "int3", "-p", "x"], env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 2 and "int3" in p.stderr and "Traceback" not in p.stderr


def test_int4_groups_round_trip_within_half_a_step_of_their_scale() -> None:
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    q, scale, zero = quantize_groups(w, 64)
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == zero.shape == (16, 4)
    steps = scale.repeat_interleave(64, dim=1)
    assert ((dequantize_groups(q, scale, zero) - w).abs() <= steps / 2 + 1e-5).all()


@pytest.mark.parametrize("rows", [48, 37])  # 37: padded to 48 for the kernel, cut from its output
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_kernel_computes_the_dequantized_weights_product(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w, x, bias = torch.randn(rows, 128, generator=g), torch.randn(5, 128, generator=g), torch.randn(rows, generator=g)
    q, scale, zero = quantize_groups(w, 32)
    layer = Int4Linear(rows, 128, 32, dtype, bias=True)
    packed, sz = pack_int4(q, scale, zero, dtype)
    layer.load_state_dict({"weight": packed, "weight_scale": sz, "bias": bias.to(dtype)}, assign=True)
    want = x @ dequantize_groups(q, scale, zero).t() + bias
    got = layer(x.to(dtype)).float()
    assert got.shape == (5, rows)
    tol = 1e-4 if dtype == torch.float32 else 0.05  # bfloat16: scales, zeros and activations rounded
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert (layer.weight.float() - dequantize_groups(q, scale, zero)).abs().max() <= tol * w.abs().max()
    alone = layer(x[2:3].to(dtype))
    assert torch.equal(alone, layer(x.to(dtype))[2:3])  # a row's result does not depend on its batch mates


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_int4_packs_the_linear_layers_keeps_the_embedding_int8_and_the_planner_counts_it(folder: Path) -> None:
    full = load_model(folder, "cpu", torch.float32)
    int8 = load_model(folder, "cpu", torch.float32, "int8")
    int4 = load_model(folder, "cpu", torch.float32, "int4")
    linears = [m for m in int4.modules() if isinstance(m, Int4Linear)]
    assert linears and not any(isinstance(m, torch.nn.Linear) for m in int4.modules())
    assert int4.parts()[0].qweight.dtype == torch.int8
    assert _bytes(int4) < 0.85 * _bytes(int8)
    assert abs(weights_bytes(shape_of_model(full), "float32", "int4") / _bytes(int4) - 1) < 0.1
    ids = torch.arange(5, 29).view(2, 12)
    with torch.no_grad():
        a, b = full(ids), int4(ids)
        assert torch.equal(int4(ids[1:]), b[1:])  # a row alone as in its batch
    assert not torch.equal(a, b)
    assert torch.isfinite(b).all()
    if folder.name != "llada_hf":  # its random weights of a large spread are far from a trained model's
        assert (a - b).norm() < 0.2 * a.norm()


def test_an_untied_int4_head_runs_the_kernel_never_the_dequantized_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(FOLDERS[1], "cpu", torch.float32, "int4")  # dream_tiny: its own lm_head
    assert isinstance(model.head_layer(), Int4Linear)
    h = torch.randn(2, 3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    want = model.head_layer()(h)[..., : model.cfg.vocab_size]

    def dequantized(self: Int4Linear) -> torch.Tensor:
        raise AssertionError("the head read its int4 weight as a matrix")

    monkeypatch.setattr(Int4Linear, "weight", property(dequantized))
    with torch.no_grad():
        assert torch.equal(model.head(h), want)


def test_int4_answers_stay_close_on_the_embedded_model() -> None:
    full, int4 = _embedded_answers("none"), _embedded_answers("int4")
    assert full != int4  # the weights did change
    assert sum(a.split()[:2] == b.split()[:2] for a, b in zip(full, int4)) >= len(EMBEDDED_PROMPTS) // 2


def test_int4_on_cuda_without_bfloat16_is_refused_by_name() -> None:
    """torch's CUDA int4 kernel takes bfloat16 activations: float32 weights there are refused before any
    CUDA call (so this runs without a GPU)."""
    with pytest.raises(UsageError, match="--quantize int4 on CUDA needs --dtype bfloat16"):
        load_model(FOLDERS[0], "cuda", torch.float32, "int4")
