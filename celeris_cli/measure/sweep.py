"""The step sweep: the same prompts at several totals of denoising steps, on each model with its own
defaults otherwise, with quality, time, forwards and peak memory per step count (`celeris bench sweep`).

`denoise_steps` is the total over the answer on every model (block diffusion spreads it over its blocks),
so the rows of two models with different strategies compare the same budget of steps.
"""

from __future__ import annotations

from typing import Any

from ..engine import Engine
from .bench import hardware, run_mode
from .evaluate import EvalSet


def step_sweep(
    engines: list[Engine],
    steps: list[int],
    n_prompts: int = 32,
    batch_size: int = 16,
    gen_length: int | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One row per (model, step count): the model's default mode at `denoise_steps` N on held-out poem
    openings. `gen_length`: the answer's length for every model (default: each model's own); `settings`
    apply to the first model only (as bench's --set)."""
    prompts = [r["prompt"] for r in EvalSet.load().poems[:n_prompts]]
    rows = []
    for i, engine in enumerate(engines):
        layer = {**(settings or {} if i == 0 else {}), **({"gen_length": gen_length} if gen_length else {})}
        base = engine.params(layer)
        run_mode(engine, prompts[:1], base, 1)  # warm up, so the first row's time is not the first forward's
        for n in steps:
            params = base.with_(denoise_steps=n)
            result = run_mode(engine, prompts, params, batch_size)
            del result["texts"]
            rows.append({"model": engine.model_dir.name if engine.model_dir else "?", "strategy": params.strategy,
                         "gen_length": params.gen_length, "denoise_steps": n, **result})  # fmt: skip
    return {
        "hardware": hardware(),
        "device": str(engines[0].device),
        "dtype": str(engines[0].dtype).replace("torch.", ""),
        "prompts": len(prompts),
        "batch_size": batch_size,
        "rows": rows,
    }


def render_sweep(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    hw = report["hardware"]
    title = (
        f"denoising steps vs quality, time and memory: {report['prompts']} poem openings, batch "
        f"{report['batch_size']}, {report['device']} {report['dtype']}, {hw.get('cpu', '')}"
    )
    table = Table(title=title)
    columns = ("model", "strategy", "gen", "steps", "NFE", "tokens/s", "wall s", "peak MB", "structure", "distinct-2")
    for c in columns:
        table.add_column(c)
    for r in report["rows"]:
        table.add_row(
            r["model"], r["strategy"], str(r["gen_length"]), str(r["denoise_steps"]), str(r["nfe"]),
            f"{r['tokens_per_s']:.1f}", f"{r['wall_s']:.2f}", f"{r['peak_mem_mb']:.0f}",
            f"{r['structure_rate']:.3f}", f"{r['distinct_2']:.3f}",
        )  # fmt: skip
    Console(width=max(Console().width, 120)).print(table)
