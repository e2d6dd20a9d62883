"""Static batches versus the running set on one workload (`celeris bench --workload mixed`).

The workload spreads answer lengths wide, as real bulk jobs do: held-out poem and English openings
interleaved (the default model gives them different presets, so different block widths), each asking for
an answer of its own length (16 to 256 tokens, cycling). Both runs use the same decoder and the same
admission order; they differ only in when a row's place is given to the next request: `static` waits for
the whole batch to finish, `continuous` admits the next request at once.
"""

from __future__ import annotations

import time
from typing import Any

from ..engine import Engine
from ..errors import UsageError
from .bench import hardware
from .evaluate import EvalSet

GEN_LENGTHS = (16, 32, 64, 128, 256)


def mixed_workload(engine: Engine, n_prompts: int, settings: dict[str, Any] | None = None) -> list[tuple[str, Any]]:
    """(prompt, final settings) for n prompts: poems and English interleaved, gen_length cycling through
    GEN_LENGTHS (capped by the model's context), seed i for prompt i, presets by script applied."""
    evalset = EvalSet.load()
    pool = [r["prompt"] for pair in zip(evalset.poems, evalset.english) for r in pair]
    if n_prompts > len(pool):
        raise UsageError(f"the mixed workload has {len(pool)} prompts, asked for {n_prompts}")
    rows = []
    for i, prompt in enumerate(pool[:n_prompts]):
        room = engine.max_length - len(engine.encode_prompt(prompt))
        gen = min(GEN_LENGTHS[i % len(GEN_LENGTHS)], room)
        params = engine.params({**(settings or {}), "gen_length": gen, "seed": i})
        rows.append((prompt, engine.params_for(prompt, params)))
    return rows


def compare_scheduling(
    engine: Engine, n_prompts: int = 256, batch_size: int = 16, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Decode the mixed workload twice in one run, static then continuous; per run: output tokens/s,
    occupancy (rows in flight per round over batch_size), rows per forward, NFE, wall; and how many
    answers are identical between the two."""
    rows = mixed_workload(engine, n_prompts, settings)
    refused = sorted({p.strategy for _, p in rows if not engine.continuous(p)})
    if refused:
        raise UsageError(
            f"the running set decodes block diffusion without guidance (block-fast); this model's "
            f"settings give {', '.join(refused)}, which decodes in static batches only"
        )
    prompts = [p for p, _ in rows]
    params = [s for _, s in rows]
    encoded = [engine.encode_prompt(p) for p in prompts]
    seeds = [s.seed for s in params]
    engine.decode_running(prompts[:2], encoded[:2], params[:2], seeds[:2], 2)  # warm up
    runs: dict[str, dict[str, Any]] = {}
    texts: dict[str, list[str]] = {}
    for name, refill in (("static", False), ("continuous", True)):
        t0 = time.perf_counter()
        results = engine.decode_running(prompts, encoded, params, seeds, batch_size, refill=refill)
        wall = time.perf_counter() - t0
        occ = engine.last_occupancy
        assert occ is not None
        tokens = sum(r.output_tokens for r in results)
        texts[name] = [r.text for r in results]
        runs[name] = {
            "tokens_per_s": round(tokens / wall, 2),
            "occupancy": round(occ.mean_in_flight / batch_size, 3),
            "rows_per_forward": round(occ.mean_rows, 2),
            "nfe": occ.forwards + occ.prefills,
            "wall_s": round(wall, 2),
            "output_tokens": tokens,
        }
    same = sum(a == b for a, b in zip(texts["static"], texts["continuous"]))
    return {
        "hardware": hardware(),
        "model": engine.model_dir.name if engine.model_dir else "?",
        "dtype": str(engine.dtype).replace("torch.", ""),
        "prompts": len(prompts),
        "batch_size": batch_size,
        "gen_lengths": list(GEN_LENGTHS),
        "block_lengths": sorted({p.block_length for p in params}),
        "scheduling": runs,
        "speedup": round(runs["continuous"]["tokens_per_s"] / max(runs["static"]["tokens_per_s"], 1e-9), 3),
        "identical_answers": same,
        "answers": len(prompts),
    }


def render_scheduling(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']}, {report['prompts']} prompts, batch {report['batch_size']}")
    for col in ("scheduling", "tokens/s", "occupancy", "rows/forward", "NFE", "wall s"):
        table.add_column(col)
    for name, row in report["scheduling"].items():
        table.add_row(
            name,
            f"{row['tokens_per_s']:.1f}",
            f"{row['occupancy']:.3f}",
            f"{row['rows_per_forward']:.2f}",
            str(row["nfe"]),
            f"{row['wall_s']:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"continuous / static: {report['speedup']:.2f}x; identical answers: "
        f"{report['identical_answers']} / {report['answers']} ({report['dtype']})"
    )
