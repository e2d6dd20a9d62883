"""The planner's estimates for published models on 8, 24 and 80 GB cards (docs/memory.md's table): the
weights and the largest batch that fits 90% of the card (the default CUDA budget), for a 64-token prompt
and 256 generated tokens, in bfloat16 and with int8 and int4 weights. Estimates, not measurements.

    python scripts/memory_table.py
    python scripts/memory_table.py --family diffusion-gemma

`--family diffusion-gemma`: DiffusionGemma-26B-A4B on 24, 48 and 80 GB cards, from the released shape's
config.json alone (`tests/data/diffusion_gemma/shape_26b_a4b`, no weights), with its folder's defaults
(one 256-token canvas), through the code `celeris inspect --memory` runs.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from celeris_cli.arch.budget import folder_report
from celeris_cli.arch.memory import Request, Shape, largest_batch, plan
from celeris_cli.arch.memory_sizes import shape_from_dims

# model card figures (config.json of each release)
MODELS: dict[str, tuple[Shape, Request]] = {
    "LLaDA-8B": (
        shape_from_dims(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=12288, rows=126464),
        Request("fast", 1, 64, 256, 32, cache="dual"),
    ),
    "Dream-7B": (
        shape_from_dims(layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, rows=152064),
        Request("fast", 1, 64, 256, 32, cache="dual"),
    ),
    "LLaDA2.0-mini": (
        shape_from_dims(layers=20, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5120, rows=157184,
                        experts=256, expert_ffn=512, experts_per_token=8, shared_experts=1, dense_layers=1),
        Request("block-fast", 1, 64, 256, 32),
    ),
    "SDAR-4B": (
        shape_from_dims(layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728, rows=151936, tied=True),
        Request("block-fast", 1, 64, 256, 4),
    ),
}  # fmt: skip
CARDS = (8, 24, 80)
GEMMA = Path(__file__).resolve().parents[1] / "tests" / "data" / "diffusion_gemma" / "shape_26b_a4b"


GEMMA_CARDS = (24, 48, 80)


def diffusion_gemma() -> None:
    cards = " | ".join(f"{c} GB card: rows" for c in GEMMA_CARDS)
    print(f"| DiffusionGemma-26B-A4B | weights | 1 row | {cards} |")
    print("|---|---|---|" + "---|" * len(GEMMA_CARDS))
    for quantize in ("none", "int8", "int4"):
        one = folder_report(GEMMA, 1, 64, "bfloat16", quantize)
        cells = []
        for card in GEMMA_CARDS:
            fits = folder_report(GEMMA, 1, 64, "bfloat16", quantize, f"{int(0.9 * card * 10**9)}B")["largest_batch"]
            cells.append(str(fits) if fits else "does not fit")
        label = "bf16" if quantize == "none" else quantize
        sizes = f"{one['weights'] / 2**30:.1f} GiB | {one['peak'] / 2**30:.1f} GiB"
        print(f"| {label} | {sizes} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("published", "diffusion-gemma"), default="published")
    if parser.parse_args().family == "diffusion-gemma":
        diffusion_gemma()
        return
    head = "| model | params | weights | " + " | ".join(f"{c} GB card: largest batch" for c in CARDS) + " |"
    print(head)
    print("|" + "---|" * (3 + len(CARDS)))
    for name, (shape, req) in MODELS.items():
        for dtype, quantize in (("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")):
            r = replace(req, dtype=dtype, quantize=quantize)  # type: ignore[arg-type]
            w = plan(shape, r).weights / 2**30
            cells = []
            for card in CARDS:
                k = largest_batch(shape, r, int(0.9 * card * 10**9))
                one = plan(shape, replace(r, batch=1)).peak / 2**30
                cells.append(f"{k} (1 row: {one:.1f} GiB)" if k else f"does not fit ({one:.1f} GiB for 1 row)")
            label = "bf16" if quantize == "none" else quantize
            print(
                f"| {name} ({r.strategy}) {label} | {shape.params / 1e9:.1f}B | {w:.1f} GiB | "
                + " | ".join(cells)
                + " |"
            )


if __name__ == "__main__":
    main()
