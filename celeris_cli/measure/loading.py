"""Peak memory while loading a checkpoint: a random LLaDA-layout checkpoint of a given size is written to a
temporary folder, then loaded in a fresh process, whose peak resident memory is compared with the weights'
size. The loader reads each tensor into its own memory and casts it in pieces, so the peak should stay
near the weights (the goal: at most 1.2x)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ModelError

CHILD = """
import json, resource, sys, time
import torch
from celeris_cli.arch.checkpoint import load_model
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
model = load_model(sys.argv[1], "cpu", getattr(torch, sys.argv[2]))
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"base": base, "peak": peak, "weights": weights, "load_s": wall}))
"""


def _llada(size_gb: float) -> tuple[dict[str, Any], Any]:
    """A LLaDA-layout config of about `size_gb` GB in bfloat16, and its model class."""
    from ..arch.llada import LLaDAModel, ModelConfig

    d, mlp, vocab = 2048, 5632, 32000
    per_layer = 4 * d * d + 3 * d * mlp
    layers = max(1, round((size_gb * 2**30 / 2 - 2 * vocab * d) / per_layer))
    cfg = ModelConfig(
        d_model=d, n_layers=layers, n_heads=16, mlp_hidden_size=mlp, vocab_size=vocab,
        mask_token_id=vocab - 1, eos_token_id=vocab - 2,
    )  # fmt: skip
    return cfg.to_dict(), LLaDAModel(cfg)


def _moe(size_gb: float) -> tuple[dict[str, Any], Any]:
    """A Qwen3-MoE-layout (SDAR-MoE) config of about `size_gb` GB in bfloat16: 64 experts of 768 per layer,
    so nearly every byte is an expert's, as in the 30B-A3B checkpoints."""
    from ..arch.sdar import SDARConfig, SDARModel

    d, experts, ffn, vocab = 1024, 64, 768, 32000
    per_layer = 4 * d * d + experts * 3 * d * ffn + experts * d
    layers = max(1, round((size_gb * 2**30 / 2 - 2 * vocab * d) / per_layer))
    raw = {
        "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe", "hidden_size": d,
        "intermediate_size": 4 * d, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "vocab_size": vocab, "num_experts": experts,
        "num_experts_per_tok": 8, "moe_intermediate_size": ffn, "norm_topk_prob": True,
        "mask_token_id": vocab - 1, "eos_token_id": vocab - 2,
    }  # fmt: skip
    return raw, SDARModel(SDARConfig.from_dict(raw))


def write_random_checkpoint(folder: Path, size_gb: float, moe: bool = False) -> int:
    """A checkpoint of about `size_gb` GB in bfloat16 (uninitialised values; only the size matters here),
    LLaDA's layout or (`moe`) a mixture of experts in Qwen3-MoE's, as 2 shards with an index, as published
    checkpoints are. Returns its bytes."""
    import torch
    from safetensors.torch import save_file

    with torch.device("meta"):
        config, model = (_moe if moe else _llada)(size_gb)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map, total = {}, 0
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        state = {n: torch.empty(shapes[n], dtype=torch.bfloat16) for n in part}
        save_file(state, str(folder / fname), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in state.values())
        weight_map.update({n: fname for n in part})
        del state
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    return total


def measure_loading(
    size_gb: float, dtypes: tuple[str, ...] = ("bfloat16", "float32"), moe: bool = False
) -> list[dict[str, Any]]:
    """One row per target dtype: weights loaded, process memory before and at peak, and their ratio."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="celeris-load-") as tmp:
        folder = Path(tmp) / "random"
        on_disk = write_random_checkpoint(folder, size_gb, moe)
        for dtype in dtypes:
            out = subprocess.run([sys.executable, "-c", CHILD, str(folder), dtype], capture_output=True, text=True)
            if out.returncode != 0:
                raise ModelError(f"loading the random checkpoint failed: {out.stderr.strip()[-500:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(
                {
                    "on_disk_gb": round(on_disk / 2**30, 2),
                    "dtype": dtype,
                    "weights_gb": round(r["weights"] / 2**30, 2),
                    "base_rss_gb": round(r["base"] / 2**30, 2),
                    "peak_rss_gb": round(r["peak"] / 2**30, 2),
                    "peak_over_weights": round(r["peak"] / r["weights"], 3),
                    "added_over_weights": round((r["peak"] - r["base"]) / r["weights"], 3),
                    "load_s": round(r["load_s"], 1),
                }
            )
    return rows
