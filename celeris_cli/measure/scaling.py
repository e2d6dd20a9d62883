"""`celeris bench scaling`: how output tokens/s and peak memory grow with the work, for the reference
decoder and the default mode, over generation lengths x batch sizes.

Each cell decodes one batch of held-out poem openings (as many as the batch holds) with the model's
settings at that gen_length (steps = gen_length unless given). A cell whose prompt plus gen_length does not
fit the model's context is reported as skipped, with the reason, not left out silently.
"""

from __future__ import annotations

from typing import Any

from ..engine import Engine
from .bench import hardware, modes_for, run_mode
from .evaluate import EvalSet

GEN_LENGTHS = (64, 256, 1024)
BATCHES = (1, 16, 64)


def scaling(
    engine: Engine,
    gen_lengths: tuple[int, ...] = GEN_LENGTHS,
    batches: tuple[int, ...] = BATCHES,
    block_length: int | None = None,
    steps: int | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    table, default_mode = modes_for(engine)
    baseline = next(iter(table))
    poems = [r["prompt"] for r in EvalSet.load().poems]
    knob = "block_steps" if "block" in baseline else "denoise_steps"
    cells: list[dict[str, Any]] = []
    for gen_length in gen_lengths:
        for batch in batches:
            prompts = [poems[i % len(poems)] for i in range(batch)]
            longest = max(len(engine.encode_prompt(p)) for p in prompts)
            cell: dict[str, Any] = {"gen_length": gen_length, "batch": batch}
            if longest + gen_length > engine.max_length:
                cell["skipped"] = f"prompt {longest} + gen_length {gen_length} > context {engine.max_length}"
                cells.append(cell)
                continue
            overrides: dict[str, Any] = {**(settings or {}), "gen_length": gen_length}
            if block_length:
                overrides["block_length"] = block_length
            if knob == "denoise_steps":  # one token per step, as the main table runs, unless given
                overrides[knob] = min(steps or gen_length, gen_length)
            elif steps:
                overrides[knob] = steps
            base = engine.params(overrides)
            for name in (baseline, default_mode):
                r = run_mode(engine, prompts, base.with_(**table[name]), batch)
                r.pop("texts")
                cell[name] = {
                    k: r[k]
                    for k in (
                        "tokens_per_s",
                        "wall_s",
                        "nfe",
                        "output_tokens",
                        "peak_mem_mb",
                        "positions_per_output_token",
                    )
                }
            ref = cell[baseline]["tokens_per_s"]
            cell["speedup"] = round(cell[default_mode]["tokens_per_s"] / ref, 2) if ref else None
            cells.append(cell)
    return {
        "hardware": hardware(),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "baseline": baseline,
        "default_mode": default_mode,
        "steps": "gen_length" if steps is None else steps,
        "cells": cells,
    }


def render_scaling(report: dict[str, Any]) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 10_000)
    hw = report["hardware"]
    console.print(
        f"[bold]celeris bench scaling[/] {hw['cpu']} ({hw['cores']} cores, {hw['threads']} threads), torch "
        f"{hw['torch']}, {report['device']} {report['dtype']}, steps {report['steps']}"
    )
    ref, default = report["baseline"], report["default_mode"]
    table = Table()
    for c in (
        "gen_length",
        "batch",
        f"{ref} tok/s",
        f"{default} tok/s",
        "speedup",
        f"{ref} peak MB",
        f"{default} peak MB",
    ):
        table.add_column(c, justify="right")
    for cell in report["cells"]:
        if "skipped" in cell:
            table.add_row(str(cell["gen_length"]), str(cell["batch"]), cell["skipped"], "", "", "", "")
            continue
        a, b = cell[ref], cell[default]
        table.add_row(
            str(cell["gen_length"]),
            str(cell["batch"]),
            f"{a['tokens_per_s']:.1f}",
            f"{b['tokens_per_s']:.1f}",
            f"{cell['speedup']}",
            f"{a['peak_mem_mb']:.0f}",
            f"{b['peak_mem_mb']:.0f}",
        )
    console.print(table)
