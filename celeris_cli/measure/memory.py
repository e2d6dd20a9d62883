"""The memory planner checked against measurement: each shape is decoded in a fresh process, and the peak
resident memory it adds is set beside the planner's estimate.

What is counted, and why: the child first runs every kind of kernel a decode uses on tiny tensors, so the
libraries' own one-time memory (thread pools, oneDNN's buffers) is in its baseline, not charged to the
model; the baseline is its resident memory then (VmRSS). It then loads the weights, resets the kernel's
peak counter (`/proc/self/clear_refs`, so the loader's own transient peak is left out) and decodes; the
measured peak is the high-water mark (VmHWM) minus the baseline. glibc's allocator keeps some freed memory
and may fragment, so the figure is what a user's process really holds, not the bytes torch has live.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ModelError
from ..strategy import STRATEGIES

CHILD = "from celeris_cli.measure.memory import child; child()"


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise ModelError(f"/proc/self/status has no {key}")


def _warm_up() -> None:
    import torch
    import torch.nn.functional as F

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 8, 32, dtype=dtype)
        w = torch.randn(32, 32, dtype=dtype)
        q = F.linear(x, w).view(4, 8, 2, 16).transpose(1, 2)
        mask = torch.ones(4, 1, 1, 8, dtype=torch.bool)
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask, enable_gqa=False)
        F.scaled_dot_product_attention(q.float(), q.float(), q.float(), attn_mask=mask)
        F.softmax(x.float(), -1).topk(2, -1)
        F.embedding(torch.tensor([[1, 2]]), w)
    torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):  # building on the meta device imports much of torch's Python (once)
        torch.nn.Linear(2, 2), torch.nn.Embedding(2, 2)


def child() -> None:
    """Run in a fresh interpreter: decode one shape (argv[1], JSON) and print the figures as JSON."""
    import time

    import torch

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec.get("threads", 1))
    from ..arch.checkpoint import load_model, read_folder
    from ..arch.folder import ModelFolder
    from ..decode.sampling import RowNoise
    from ..decode.strategies import Net, SpecialTokens, get_strategy
    from ..params import GenerationParams

    _warm_up()
    base, base_file = _status("VmRSS"), _status("RssFile")
    folder = Path(spec["folder"])
    arch, cfg = read_folder(folder)
    params = GenerationParams.from_mapping(spec["settings"], ModelFolder.open(folder).defaults())
    model = load_model(folder, "cpu", getattr(torch, spec["dtype"]), **_quantize(spec))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM: the decode's peak, not the loader's
    loaded = _status("VmRSS")
    B, P = spec["batch"], spec["prompt"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, cfg.vocab_size, (B, P), generator=gen)
    assert cfg.mask_token_id is not None and cfg.eos_token_id is not None, "a random checkpoint names both"
    special = SpecialTokens(cfg.mask_token_id, frozenset({cfg.eos_token_id}), cfg.pad_token_id or cfg.eos_token_id)
    noise = RowNoise(list(range(B)), torch.device("cpu"))
    t0 = time.perf_counter()
    spread = spec.get("prompt_spread", 0) + 1  # rows up to `spread` tokens shorter: they end at different blocks
    if STRATEGIES[params.strategy].running == "block":  # as the engine runs it: a running set, all rows at once
        from ..decode.running import BlockScheduler
        from ..decode.runset import RowRequest
        from ..decode.strategies import plan_of

        plan = plan_of(params)
        net = Net(model)  # type: ignore[arg-type]
        running = BlockScheduler(net, special.mask_id, special.stop_ids, special.pad_id, B, prompt.device)
        requests = [RowRequest(b, prompt[b, b % spread :].tolist(), plan, b) for b in range(B)]
        for _ in running.run(requests):
            pass
    else:
        mask = torch.ones(B, P, dtype=torch.bool)
        for b in range(B):  # left-padded
            mask[b, : b % spread] = False
        get_strategy(params.strategy)(Net(model), prompt, mask, params, special, noise)  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    out = {"base": base, "loaded": loaded, "peak": _status("VmHWM"), "weights": weights, "wall_s": wall}
    out["code_pages"] = _status("RssFile") - base_file  # libraries' code paged in after the baseline
    print(json.dumps(out))


def _quantize(spec: dict[str, Any]) -> dict[str, Any]:
    return {"quantize": spec["quantize"]} if spec.get("quantize", "none") != "none" else {}


def predicted(spec: dict[str, Any]) -> Any:
    """The planner's estimate for a spec (an `Estimate`)."""
    import torch

    from ..arch.checkpoint import read_folder
    from ..arch.folder import ModelFolder
    from ..arch.memory import plan, request_of, shape_of_model
    from ..params import GenerationParams

    folder = Path(spec["folder"])
    arch, cfg = read_folder(folder)
    params = GenerationParams.from_mapping(spec["settings"], ModelFolder.open(folder).defaults())
    with torch.device("meta"):
        shape = shape_of_model(arch.build(cfg))
    req = request_of(params, spec["batch"], spec["prompt"], spec["dtype"], spec.get("quantize", "none"))
    return plan(shape, req)


# glibc's default threshold moves up as large blocks are freed, after which they come from its heap and
# stay resident once freed; with a fixed threshold every block of 64 KiB or more is its own mapping,
# returned to the system when freed, so the peak is that of the memory live at once.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def _run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, env={**os.environ, **env}
    )
    if out.returncode != 0:
        raise ModelError(f"measuring {spec['name']} failed: {out.stderr.strip()[-800:]}")
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    r["added"] = r["peak"] - r["base"] - r["code_pages"]
    return r


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: the shape, the estimate split, the peak added with glibc's allocator as it comes and with
    a fixed mmap threshold (the live memory), and the estimate over the latter."""
    live = _run_child(spec, FIXED_MMAP)
    default = _run_child(spec, {}) if spec.get("glibc_default", True) else None
    est = predicted(spec)
    mib = 2**20
    return {
        "model": spec["name"],
        "strategy": spec["settings"].get("strategy", "default"),
        "dtype": spec["dtype"],
        "quantize": spec.get("quantize", "none"),
        "batch": spec["batch"],
        "prompt": spec["prompt"],
        "settings": spec["settings"],
        "weights_mib": round(est.weights / mib, 1),
        "kv_cache_mib": round(est.kv_cache / mib, 1),
        "activations_mib": round(est.activations / mib, 1),
        "logits_mib": round(est.logits / mib, 1),
        "predicted_mib": round(est.peak / mib, 1),
        "measured_mib": round(live["added"] / mib, 1),
        "measured_glibc_default_mib": round(default["added"] / mib, 1) if default else None,
        "loaded_weights_mib": round(live["weights"] / mib, 1),
        "predicted_over_measured": round(est.peak / live["added"], 3),
        "decode_s": round(live["wall_s"], 1),
    }


# LLaDA-layout random checkpoints shaped as published 0.5B and 1.5B models (Qwen2.5's sizes, tied head)
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "random-0.5B": {"d_model": 896, "n_layers": 24, "n_heads": 14, "n_kv_heads": 2, "mlp_hidden_size": 4864},
    "random-1.5B": {"d_model": 1536, "n_layers": 28, "n_heads": 12, "n_kv_heads": 2, "mlp_hidden_size": 8960},
}
RANDOM_VOCAB = 151936


def write_random(folder: Path, dims: dict[str, Any], seed: int = 0) -> Path:
    """A random LLaDA-layout checkpoint in bfloat16, written one tensor at a time (std 0.02 weights)."""
    import torch
    from safetensors.torch import save_file

    from ..arch.checkpoint import INDEX
    from ..arch.llada import LLaDAModel, ModelConfig

    cfg = ModelConfig(
        vocab_size=RANDOM_VOCAB, mask_token_id=RANDOM_VOCAB - 1, eos_token_id=RANDOM_VOCAB - 2,
        weight_tying=True, max_sequence_length=4096, **dims,
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LLaDAModel(cfg).state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()), encoding="utf-8")
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, (name, shape) in enumerate(shapes.items()):
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        fname = f"part-{i:04d}.safetensors"
        save_file({name: t.to(torch.bfloat16)}, str(folder / fname), metadata={"format": "pt"})
        weight_map[name] = fname
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}), encoding="utf-8")
    return folder


def check(specs: list[dict[str, Any]], random_shapes: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Measure each spec; `random_shapes` names RANDOM_SHAPES to write to a temporary folder first (a
    spec's folder may then be given as that name)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="celeris-mem-") as tmp:
        made = {name: str(write_random(Path(tmp) / name, RANDOM_SHAPES[name])) for name in random_shapes}
        for spec in specs:
            rows.append(measure({**spec, "folder": made.get(spec["folder"], spec["folder"])}))
    return rows


def default_specs(threads: int = 2) -> list[dict[str, Any]]:
    """The shapes `celeris bench memory` measures. Every row decodes to the end of its canvas (no early
    exit; on celeris-block, min_tokens holds the answer open), the case the planner sizes batches for.
    The random checkpoints run in bfloat16 at a small batch: this CPU emulates bfloat16 slowly. The last
    three predict a 256-token block for 4 rows of a 151,936-token vocabulary in one step, in float32: the
    LM head's logits are bounded by its chunk (`arch.memory_sizes.logit_chunk`), not by the block; the last
    samples over the whole vocabulary (float64 copies, `arch.memory.whole_draw`)."""
    from ..engine import embedded_models

    models = embedded_models()
    whole = {"gen_length": 256, "min_tokens": 256}
    short = {"gen_length": 64, "block_length": 32, "denoise_steps": 4, "early_exit": False}
    one_block = {"gen_length": 256, "block_length": 256, "denoise_steps": 2}
    return [
        {"name": "celeris-block", "folder": str(models["celeris-block"]), "dtype": "float32", "batch": 16,
         "prompt": 32, "prompt_spread": 8, "settings": whole, "threads": threads},
        {"name": "celeris-tiny", "folder": str(models["celeris-tiny"]), "dtype": "float32", "batch": 16,
         "prompt": 32, "settings": {"gen_length": 256, "early_exit": False}, "threads": threads},
        {"name": "random-0.5B", "folder": "random-0.5B", "dtype": "bfloat16", "batch": 2, "prompt": 32,
         "settings": short, "threads": threads},
        {"name": "random-1.5B", "folder": "random-1.5B", "dtype": "bfloat16", "batch": 2, "prompt": 32,
         "settings": short, "threads": threads},
        {"name": "random-0.5B", "folder": "random-0.5B", "dtype": "float32", "batch": 4, "prompt": 32,
         "settings": {**one_block, "strategy": "reference"}, "threads": threads, "glibc_default": False},
        {"name": "random-0.5B", "folder": "random-0.5B", "dtype": "float32", "batch": 4, "prompt": 32,
         "settings": {**one_block, "strategy": "fast", "early_exit": False}, "threads": threads,
         "glibc_default": False},
        {"name": "random-0.5B", "folder": "random-0.5B", "dtype": "float32", "batch": 4, "prompt": 32,
         "settings": {**one_block, "strategy": "fast", "early_exit": False, "temperature": 1.0},
         "threads": threads, "glibc_default": False},
    ]  # fmt: skip


def check_default(threads: int = 2) -> dict[str, Any]:
    from .bench import hardware

    rows = check(default_specs(threads), tuple(RANDOM_SHAPES))
    return {"hardware": hardware(), "memory": rows}


def render_check(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="memory planner vs measured peak added (MiB; measured with a fixed mmap threshold)")
    cols = ["model", "strategy", "dtype", "batch", "weights_mib", "kv_cache_mib", "activations_mib", "logits_mib"]
    cols += ["predicted_mib", "measured_mib", "measured_glibc_default_mib", "predicted_over_measured"]
    for c in cols:
        table.add_column(c.replace("_mib", ""))
    for row in report["memory"]:
        table.add_row(*(str(row[c]) for c in cols))
    Console().print(table)
