"""DiffusionGemma's memory plan (`arch.canvas_memory`): the weights are the folder's text tensors, the cache is
the one a decode builds, the peak is the one torch allocates in a real decode of the tiny checkpoint (CPU), and
`celeris inspect --memory` prints the released 26B-A4B shape's estimate from its config alone."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli.arch.canvas_memory import DRAW_ENTRY, cache_bytes
from celeris_cli.arch.checkpoint import load_model, read_folder
from celeris_cli.arch.diffusion_gemma import VISION
from celeris_cli.arch.folder import ModelFolder
from celeris_cli.arch.memory import Request, plan, request_of, shape_of_model
from celeris_cli.cli import app
from celeris_cli.decode.diffusion_gemma import Context, DiffusionGemmaPlan, generate_diffusion_gemma
from celeris_cli.decode.sampling import RowNoise
from celeris_cli.decode.strategies import Net, _plan
from celeris_cli.params import GenerationParams

DATA = Path(__file__).parent / "data" / "diffusion_gemma"
TINY = DATA / "diffusion_gemma_tiny"
REAL = DATA / "shape_26b_a4b"  # the released shape's config.json and generation_config.json, no weights


def shape_of(folder: Path):  # type: ignore[no-untyped-def]
    arch, cfg = read_folder(folder)
    with torch.device("meta"):
        return shape_of_model(arch.build(cfg))


def test_the_weights_are_every_text_tensor_of_the_folder_and_no_vision_one() -> None:
    raw = (TINY / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    sizes = {k: torch.Size(v["shape"]).numel() for k, v in header.items() if k != "__metadata__"}
    text = sum(n for k, n in sizes.items() if not k.startswith(VISION))
    assert text < sum(sizes.values())  # the folder holds a vision tower, which is not loaded
    assert shape_of(TINY).params == text


def test_the_released_shape_holds_its_published_parameters() -> None:
    shape = shape_of(REAL)
    assert 25.0e9 < shape.params < 25.5e9  # 25.2B, all 128 experts of each layer resident
    assert (shape.full_layers, shape.experts, shape.experts_per_token) == (5, 128, 8)


def test_the_cache_is_the_one_a_decode_builds_every_position_of_every_layer() -> None:
    """Past the sliding window too: the cache is not trimmed, a sliding layer only reads its window."""
    model = load_model(TINY, "cpu", torch.float32)
    shape = shape_of_model(model)
    B, P, L = 3, 5, 8
    ctx = Context(Net(model), torch.randint(5, 300, (B, P)), torch.ones(B, P, dtype=torch.bool))
    for canvases in range(3):
        held = sum(t.numel() * t.element_size() for kv in ctx.cache for t in kv)
        assert held == cache_bytes(shape, B, P + canvases * L, 4)
        ctx.commit(torch.randint(5, 300, (B, L)))


def _measured_peak(batch: int, prompt: int, settings: dict[str, object], dtype: str) -> tuple[int, int]:
    """(torch's peak of live bytes in a real decode beyond the weights, the planner's), as torch's profiler
    records every CPU allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    model = load_model(TINY, "cpu", getattr(torch, dtype))
    params = GenerationParams.from_mapping(settings, ModelFolder.open(TINY).defaults())
    ids = torch.randint(5, 300, (batch, prompt), generator=torch.Generator().manual_seed(0))
    noise = RowNoise(list(range(batch)), torch.device("cpu"))
    mask = torch.ones(batch, prompt, dtype=torch.bool)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        generate_diffusion_gemma(Net(model), ids, mask, _plan(DiffusionGemmaPlan, params), frozenset(), 0, noise)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    est = plan(shape_of_model(model), request_of(params, batch, prompt, dtype))
    return peak, est.peak - est.weights


@pytest.mark.parametrize(
    "batch,prompt,settings,dtype",
    [
        (6, 10, {"gen_length": 24, "block_steps": 3, "confidence_threshold": None}, "float32"),
        (2, 40, {"gen_length": 8, "block_steps": 3}, "float32"),  # a long prompt: its pass is the peak
        (8, 3, {"gen_length": 16, "block_steps": 2}, "bfloat16"),
    ],
)
def test_the_estimate_is_within_a_tenth_of_the_peak_a_real_decode_allocates(
    batch: int, prompt: int, settings: dict[str, object], dtype: str
) -> None:
    measured, estimated = _measured_peak(batch, prompt, settings, dtype)
    assert 0.9 * measured <= estimated <= 1.1 * measured, (measured, estimated)


def test_a_rows_canvas_times_vocabulary_is_what_grows_and_it_is_not_chunked() -> None:
    shape = shape_of(REAL)
    many = Request("diffusion-gemma", 16, 64, 256, 256, dtype="bfloat16")
    a, b = plan(shape, many), plan(shape, replace(many, batch=17))
    row = 256 * 262144 * (2 + DRAW_ENTRY)  # the whole canvas x vocabulary at once: 2 GB a row, at a step's draw
    assert b.logits - a.logits == row and b.weights == a.weights
    assert b.kv_cache - a.kv_cache == cache_bytes(shape, 1, 64 + 0 * 256, 2) < row / 100  # not the cache
    assert plan(shape, replace(many, block_length=128, gen_length=128)).logits == a.logits // 2
    # one row: the head's phase is the peak, its float32 cast of the 262,144 x 2,816 embedding beside the logits
    one = plan(shape, replace(many, batch=1))
    assert one.activations == 262144 * 2816 * 4 and one.logits == 256 * 262144 * 24


def test_int8_and_int4_leave_the_experts_in_the_models_dtype() -> None:
    shape = shape_of(REAL)
    one = Request("diffusion-gemma", 1, 64, 256, 256, dtype="bfloat16")
    bf16, int4 = plan(shape, one).weights, plan(shape, replace(one, quantize="int4")).weights
    experts = 30 * 128 * 3 * 2816 * 704 * 2
    assert experts < int4 < bf16 < experts * 1.15  # experts are 90% of the weights


def test_inspect_memory_prints_the_released_shapes_estimate_from_its_config_alone() -> None:
    assert not list(REAL.glob("*.safetensors"))
    run = CliRunner().invoke(app, ["inspect", str(REAL), "--memory", "--dtype", "bfloat16", "--max-memory", "72GB"])
    assert run.exit_code == 0, run.output
    assert "diffusion-gemma, batch 1, 64 prompt + 256 generated tokens, bfloat16" in run.output
    assert "largest batch within 67.06 GiB: 10" in run.output  # 90% of an 80 GB card; vLLM's recipe runs 4
    run = CliRunner().invoke(app, ["inspect", str(REAL), "--memory", "--dtype", "bfloat16", "--max-memory", "21.6GB"])
    assert run.exit_code == 0 and "none (not even one row fits)" in run.output


def test_a_budget_below_two_rows_decodes_them_apart_with_the_same_answers() -> None:
    from celeris_cli import load_engine

    free = load_engine(TINY, device="cpu", dtype="float32")
    params = free.params({"gen_length": 8, "block_steps": 2})
    prompts = ["a b", "c d e"]
    one = free.memory.need([free.encode_prompt(p) for p in prompts[1:]], params)
    assert free.memory.need([free.encode_prompt(p) for p in prompts], params) > one > 0
    capped = load_engine(TINY, device="cpu", dtype="float32", max_memory=one)
    alone, together = capped.generate(prompts, params, batch_size=2), free.generate(prompts, params, batch_size=2)
    assert [r.batch_size for r in alone] == [1, 1] and [r.batch_size for r in together] == [2, 2]
    assert [r.text for r in alone] == [r.text for r in together]


def test_the_table_in_the_docs_is_what_the_script_prints() -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(root / "scripts" / "memory_table.py"), "--family", "diffusion-gemma"]
    table = subprocess.run(script, capture_output=True, text=True, check=True, cwd=root).stdout.strip()
    assert table.count("\n") == 4 and "| bf16 | 47.0 GiB |" in table
    assert table in (root / "docs" / "memory.md").read_text()
