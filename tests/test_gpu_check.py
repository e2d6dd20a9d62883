"""`scripts/gpu-check` runs end to end on CPU at a tiny width with LLaDA-8B's vocabulary: parity rows for each
family, one speed cell per batch size, the yardstick beside them, one JSON written as each section ends (issues
#12 and #59; the GPU figures need a GPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).parents[1]


def test_gpu_check_runs_end_to_end_on_cpu_at_a_tiny_shape(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--tiny", "--no-install",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    assert json.loads(p.stdout) == report
    assert report["complete"] and report["errors"] == {}
    assert [r["architecture"] for r in report["parity"]] == ["llada", "dream", "llada2_moe"]
    assert all(r["logits_ok"] and r["greedy_identical"] == "3/3" for r in report["parity"])  # CPU against CPU
    speed = report["speed"]
    assert speed["dtype"] == "bfloat16" and speed["workload"]["batches"] == [1, 2]
    assert speed["shape"]["vocab_size"] == 126_464 and speed["shape"]["d_model"] == 64  # 8B's vocabulary, tiny width
    for cell, batch in zip(speed["cells"], [1, 2]):
        assert cell["batch"] == batch and cell["output_tokens_per_s"] > 0
        assert cell["tokens_per_forward"] == batch  # early exit off, random weights: one token per row per step
        for key in ("positions_per_output_token", "peak_mem_mb", "of_ar_limit", "autoregressive_limit_tokens_per_s"):
            assert key in cell
    yard = report["yardstick"]  # the plain static-cache loop of the same network, eager on a CPU
    assert yard["compared"] == "eager" and yard["same_network"]["argmax_same"] == 1.0
    assert [(r["batch"], r["q"]) for r in yard["rows"]] == [(1, 1), (1, 8), (2, 1), (2, 8)]
    assert all(r["eager_positions_per_s"] > 0 and r["graph_ms"] is None for r in yard["rows"])
    assert [v["batch"] for v in yard["versus"]] == [1, 2] and all(v["celeris_ar_of_yardstick"] for v in yard["versus"])
    kernel = [r for r in report["quantization"] if "check" in r]
    assert [r["dtype"] for r in kernel] == ["float32", "bfloat16"] and all(r["row_alone_equal"] for r in kernel)
    assert kernel[0]["max_rel_diff"] < 1e-4
    models = [r for r in report["quantization"] if "model" in r]
    assert [r["quantize"] for r in models] == ["int8", "int4"] * 3 and all(r["row_alone_equal"] for r in models)
    assert {r["dtype"] for r in models if r["quantize"] == "int4"} == {"bfloat16"}  # CUDA's int4 kernel's dtype
    sched = report["scheduling"]
    assert [r["model"] for r in sched] == ["llada-8b-shape"]  # (--tiny: celeris-block's runs on a card only)
    assert [r["answers"] for r in sched] == [4]
    for r in sched:  # static against continuous: the same answers (bfloat16 allows a near tie to flip)
        assert set(r["scheduling"]) == {"static", "continuous"}
        assert r["identical_answers"] >= r["answers"] - 2
    spec = report["self_speculation"]
    assert [r["model"] for r in spec] == ["celeris-spec", "llada-8b-shape"]
    assert [r["default_mode"] for r in spec] == ["nemotron", "spec"]  # its folder's default; the architecture's
    for r in spec:  # every mode per batch size against the real AR decode; spec's answers are the AR mode's
        assert r["yardstick"] == "ar" and r["forward_cost"]["fixed"] > 0
        assert [c["batch"] for c in r["cells"]] == [1, 2] and all(r["the_ar_modes_answers"].values())
        assert {"ar", "spec", "spec-always", "nemotron"} <= set(r["cells"][0]["modes"])
    check_diffusion_gemma(report["diffusion_gemma"])
    graphs = report["cuda_graphs"]  # the steps through torch.compile (dynamo's eager backend on a CPU)
    assert graphs["backend"] == "eager" and graphs["error"] is None and graphs["captured_calls"] > 0
    assert [c["batch"] for c in graphs["cells"]] == [1] and all(c["identical"] for c in graphs["cells"])


def check_diffusion_gemma(dg: dict[str, Any]) -> None:
    """The DiffusionGemma section on the tiny checkpoint: batch 1, 4, 16 and the planner's largest within its
    stand-in budget, each with tokens/s, time to first canvas and the peak against the plan."""
    assert dg["model"]["folder"].endswith("diffusion_gemma_tiny") and dg["dtype"] == "bfloat16"
    assert dg["workload"]["gen_length"] == 16 and dg["workload"]["canvas_length"] == 8  # two canvases a row
    assert dg["workload"]["max_denoising_steps"] == 8  # --tiny's cap
    assert abs(dg["weights_bytes"] - dg["planned_weights_bytes"]) <= 0.01 * dg["weights_bytes"]
    largest = dg["planner_largest_batch"]
    assert largest >= 8 and dg["largest_batch_run"] == min(largest, 32)
    top = dg["largest_batch_run"]
    assert [c["batch"] for c in dg["cells"]] == sorted({b for b in (1, 4, 16, top) if b <= top})
    for c in dg["cells"]:
        assert 0 < c["new_tokens"] <= c["positions"] == 16 * c["batch"]
        assert c["tokens_per_s"] > 0
        assert c["canvases"] == 2 * c["batch"]  # every canvas of every row committed, each reported
        assert 0 < c["first_canvas_s_mean"] <= c["first_canvas_s_max"] <= c["wall_s"]
        assert c["first_canvas_s_mean"] < c["last_canvas_s_mean"] <= c["wall_s"]  # the first of two, not the last
        assert 0 < c["peak_beyond_weights_bytes"] <= 1.1 * c["planned_beyond_weights_bytes"]  # the plan bounds it
        assert c["planned_peak_bytes"] <= dg["budget_bytes"]
    assert dg["out_of_memory_at"] is None
    assert 0.9 <= dg["cells"][0]["measured_of_planned"] <= 1.1  # a row alone: the planner's count, within a tenth


def test_a_run_cut_off_after_its_first_section_still_reports_it(tmp_path: Path) -> None:
    """The JSON is written as each section ends: killed once parity is in, the file holds parity, whole."""
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--tiny", "--no-install",
         "--out", str(out)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a ceiling on a hang, not a timing
        while time.monotonic() < deadline and p.poll() is None:
            if out.is_file() and "parity" in json.loads(out.read_text()):
                break
            time.sleep(0.2)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert [r["architecture"] for r in report["parity"]] == ["llada", "dream", "llada2_moe"]
    assert "self_speculation" not in report and "diffusion_gemma" not in report


def _script() -> Any:
    """scripts/gpu-check as a module."""
    from importlib.machinery import SourceFileLoader
    from types import ModuleType

    loader = SourceFileLoader("gpu_check", str(REPO / "scripts" / "gpu-check"))
    check = ModuleType(loader.name)
    check.__file__ = loader.path
    loader.exec_module(check)
    return check


def test_the_released_layout_is_cut_by_whole_groups_of_layers_to_fit_the_card() -> None:
    """On a card that cannot hold the 26B-A4B, the random network keeps its layout with fewer layers: its five
    sliding layers and a full one at a time, as many as the planner fits (from the config: nothing is built)."""
    check = _script()
    _, cfg, of = check.dg_layers(check.DG_SHAPE, 72 * 10**9)
    assert (cfg.num_hidden_layers, of) == (30, 30)
    _, cfg, _ = check.dg_layers(check.DG_SHAPE, 20 * 10**9)
    assert cfg.num_hidden_layers in (6, 12, 18, 24) and len(cfg.layer_types) == cfg.num_hidden_layers
    types = cfg.layer_types
    assert types[-1] == "full_attention" and types.count("full_attention") * 6 == len(types)


def test_a_cuda_device_torch_cannot_see_is_a_usage_error() -> None:
    import torch

    if torch.cuda.is_available():
        return
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu-check"), "--device", "cuda", "--no-install", "--out", "/dev/null"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2 and "--device cuda" in p.stderr and "Traceback" not in p.stderr


def test_a_diffusion_gemma_batch_out_of_memory_keeps_the_smaller_ones_and_tries_no_larger() -> None:
    """The tiny checkpoint's engine with its decode failing as CUDA's allocator does from 16 rows on."""
    import torch

    from celeris_cli.engine import load_engine

    check = _script()
    engine = load_engine(REPO / check.DG_TINY, device="cpu", dtype="bfloat16")
    decode, tried = engine.decode_ids, []

    def short_of_memory(rows: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        tried.append(len(rows))
        if len(rows) >= 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return decode(rows, *args, **kwargs)

    engine.decode_ids = short_of_memory  # type: ignore[method-assign,assignment]
    dg = check.dg_measure(engine, {}, 2 * 2**20, "", 32, {"block_steps": 2})  # the planner's largest: 19
    assert [c["batch"] for c in dg["cells"]] == [1, 4, 16] and dg["out_of_memory_at"] == 16
    assert "tokens_per_s" in dg["cells"][1] and "out of memory" in dg["cells"][2]["error"]
    assert max(tried) == 16  # the planner's largest (19) is not tried after 16 failed
