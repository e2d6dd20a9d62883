"""DiffusionGemma's memory plan (`arch.canvas_memory`): the weights are the folder's text tensors, the cache is
the one a decode builds, the peak is the one torch allocates in a real decode of the tiny checkpoint (CPU), and
`celeris inspect --memory` prints the released 26B-A4B shape's estimate from its config alone."""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli.arch.canvas_memory import CHUNK_ENTRY, cache_bytes, canvas_chunk, canvas_phases, expert_bytes
from celeris_cli.arch.checkpoint import load_model, read_folder
from celeris_cli.arch.diffusion_gemma import VISION
from celeris_cli.arch.folder import ModelFolder
from celeris_cli.arch.memory import Estimate, Request, plan, request_of, shape_of_model
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


def _model(vocab: int | None, dtype: torch.dtype) -> Any:
    """The tiny checkpoint, or a network of its shape with another vocabulary (random weights)."""
    if vocab is None:
        return load_model(TINY, "cpu", dtype)
    arch, cfg = read_folder(TINY)
    torch.manual_seed(0)
    model = arch.build(dataclasses.replace(cfg, vocab_size=vocab)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def _measured_peak(
    batch: int,
    prompt: int,
    settings: dict[str, object],
    dtype: str,
    vocab: int | None = None,
    chunk: int | None = None,
    padded: bool = True,
) -> tuple[int, int]:
    """(torch's peak of live bytes in a real decode beyond the weights, the planner's), as torch's profiler
    records every CPU allocation and free. padded: the first row's prompt one token shorter (left padding: the
    attention then repeats the keys to every head, which the planner counts, not knowing the rows)."""
    from torch.profiler import ProfilerActivity, profile

    model = _model(vocab, getattr(torch, dtype))
    params = GenerationParams.from_mapping(settings, ModelFolder.open(TINY).defaults())
    ids = torch.randint(5, 300, (batch, prompt), generator=torch.Generator().manual_seed(0))
    noise = RowNoise(list(range(batch)), torch.device("cpu"))
    mask = torch.ones(batch, prompt, dtype=torch.bool)
    mask[0, 0] = not padded
    plan_ = _plan(DiffusionGemmaPlan, params)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        generate_diffusion_gemma(Net(model), ids, mask, plan_, frozenset(), 0, noise, chunk=chunk)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    est = max(canvas_phases(shape_of_model(model), request_of(params, batch, prompt, dtype), chunk), key=_peak)
    return peak, est.peak - est.weights


def _peak(e: Estimate) -> int:
    return e.peak


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
    unpadded, _ = _measured_peak(batch, prompt, settings, dtype, padded=False)
    assert unpadded <= 1.1 * estimated  # without padding the keys are not repeated: less, or the prompt's pass


CANVAS = {"gen_length": 64, "block_length": 64, "block_steps": 2}


@pytest.mark.parametrize(
    "vocab,chunk,dtype",
    [
        (16384, None, "float32"),
        (16384, 16, "float32"),
        (4096, 48, "float32"),
        (8192, 32, "bfloat16"),
        (8192, 5, "float32"),
    ],
)
def test_the_chunked_steps_estimate_is_within_a_few_percent_at_several_vocabularies_and_chunks(
    vocab: int, chunk: int | None, dtype: str
) -> None:
    """Where the canvas times the vocabulary is the peak (a canvas of 64, vocabularies of 4,096 to 16,384): the
    chunk of a row's positions (padded to a whole tile: 5 is computed as 16) is what the step holds at once."""
    measured, estimated = _measured_peak(3, 5, CANVAS, dtype, vocab, chunk)
    assert 0.97 * measured <= estimated <= 1.03 * measured, (measured, estimated)
    if chunk == 16:
        assert measured < _measured_peak(3, 5, CANVAS, dtype, vocab, 64)[0] / 2  # a smaller chunk holds less


def test_a_row_adds_its_cache_and_activations_not_its_canvas_times_the_vocabulary() -> None:
    shape = shape_of(REAL)
    many = Request("diffusion-gemma", 16, 64, 256, 256, dtype="bfloat16")
    a, b = plan(shape, many), plan(shape, replace(many, batch=17))
    assert b.weights == a.weights and 0 < b.peak - a.peak < 256 * 262144 * 24 / 20  # 5% of one unchunked canvas
    assert canvas_chunk(262144, 256) == 64  # positions a step computes at once, whatever the batch
    one = max(canvas_phases(shape, replace(many, batch=1)), key=_peak)
    assert one.logits == 64 * 262144 * CHUNK_ENTRY + 256 * 2816 * 2  # the chunk, and the row's self-conditioning
    assert one.activations == 262144 * 2816 * 4 + 2 * 256 * 2816 * 2  # the head's float32 cast of the embedding
    assert plan(shape, replace(many, quantize="int8")).peak - plan(shape, many).peak < 0  # the weights dominate


def test_int8_and_int4_quantize_the_routed_experts_as_loaded() -> None:
    """The planner's routed experts are the bytes a quantized load holds (tiny checkpoint), and on the released
    shape they go from 90% of the bfloat16 weights to about a quarter of them under int4."""
    shape = shape_of(TINY)
    for scheme in ("none", "int8", "int4"):
        model = load_model(TINY, "cpu", torch.float32, scheme)
        stacks = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
        held = sum(t.numel() * t.element_size() for m in stacks for t in m.buffers()) + sum(
            t.numel() * t.element_size() for m in stacks for t in m.parameters()
        )
        assert held == expert_bytes(shape, 4, scheme), scheme
    real = shape_of(REAL)
    one = Request("diffusion-gemma", 1, 64, 256, 256, dtype="bfloat16")
    bf16, int8, int4 = (plan(real, replace(one, quantize=q)).weights for q in ("none", "int8", "int4"))
    experts = 30 * 128 * 3 * 2816 * 704
    assert experts * 2 < bf16 < experts * 2 * 1.15  # experts are 90% of the weights
    assert experts < int8 < bf16 * 0.55 and experts / 2 < int4 < bf16 * 0.3


def test_inspect_memory_prints_the_released_shapes_estimate_from_its_config_alone() -> None:
    assert not list(REAL.glob("*.safetensors"))
    run = CliRunner().invoke(app, ["inspect", str(REAL), "--memory", "--dtype", "bfloat16", "--max-memory", "72GB"])
    assert run.exit_code == 0, run.output
    assert "diffusion-gemma, batch 1, 64 prompt + 256 generated tokens, bfloat16" in run.output
    rows = int(run.output.split("largest batch within 67.06 GiB: ")[1].split()[0])  # 90% of an 80 GB card
    assert rows >= 40  # vLLM's recipe runs 4
    args = ["inspect", str(REAL), "--memory", "--dtype", "bfloat16", "--max-memory", "21.6GB"]
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0 and "none (not even one row fits)" in run.output
    run = CliRunner().invoke(app, args + ["--quantize", "int4", "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["largest_batch"] >= 2  # a 24 GB card's 90%


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


@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_the_released_shapes_weights_are_the_bytes_its_quantized_network_holds(scheme: str) -> None:
    """Built on the meta device and quantized as the loader does (`quantize.prepare`): every tensor's bytes,
    against the planner's weights for the released 26B-A4B shape."""
    from celeris_cli.arch.checkpoint import build_on_meta
    from celeris_cli.arch.quantize import prepare

    arch, cfg = read_folder(REAL)
    model = build_on_meta(arch, cfg).to(torch.bfloat16)
    if scheme != "none":
        with torch.device("meta"):
            prepare(model, torch.bfloat16, scheme)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    planned = plan(shape_of(REAL), Request("diffusion-gemma", 1, 64, 256, 256, "bfloat16", scheme)).weights  # type: ignore[arg-type]
    assert abs(planned - held) <= held / 1000, (planned, held)
