"""Static batches versus the running set on one workload (`celeris bench workload mixed`).

The workload spreads answer lengths wide, as real bulk jobs do: held-out poem and English openings
interleaved (the default model gives them different presets, so different block widths), each asking for
an answer of its own length (16 to 256 tokens, cycling). Both runs use the same decoder and the same
admission order (longest answers first, `decode.running`); they differ only in when a row's place is given
to the next request: `static` waits for the whole batch to finish, `continuous` admits the next one at once.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from ..decode.block import commit_step
from ..decode.sampling import Draws, stream_seed
from ..decode.strategies import Net, plan_of
from ..engine import Engine
from ..errors import UsageError
from ..strategy import STRATEGIES
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
    engine: Engine,
    n_prompts: int = 256,
    batch_size: int = 16,
    settings: dict[str, Any] | None = None,
    pairs: int = 1,
) -> dict[str, Any]:
    """Decode the mixed workload static and continuous in one run, `pairs` times each, alternating which
    goes first (static first in the first pair), so that a slower stretch of a shared machine falls on
    both; per mode: output tokens/s (the median run's), occupancy (rows in flight per round over
    batch_size), rows per forward, NFE, wall; each pair's ratio and their median (`speedup`; for an even
    count of pairs, the lower of the middle two, as for the runs); and how many answers are identical
    between the two modes (in every run)."""
    rows = mixed_workload(engine, n_prompts, settings)
    refused = sorted({p.strategy for _, p in rows if not engine.continuous(p)})
    if refused:
        raise UsageError(
            f"nothing to compare: {', '.join(refused)} decodes in static batches only (the strategies with "
            "a running set: docs/scheduling.md)"
        )
    prompts = [p for p, _ in rows]
    params = [s for _, s in rows]
    encoded = [engine.encode_prompt(p) for p in prompts]
    seeds = [s.seed for s in params]
    engine.decode_running(prompts[:2], encoded[:2], params[:2], seeds[:2], 2)  # warm up

    def run(refill: bool) -> tuple[dict[str, Any], list[str]]:
        t0 = time.perf_counter()
        results = engine.decode_running(prompts, encoded, params, seeds, batch_size, refill=refill)
        wall = time.perf_counter() - t0
        occ = engine.last_occupancy
        assert occ is not None
        tokens = sum(r.output_tokens for r in results)
        return {
            "tokens_per_s": round(tokens / wall, 2),
            "occupancy": round(occ.mean_in_flight / batch_size, 3),
            "rows_per_forward": round(occ.mean_rows, 2),
            "nfe": occ.forwards + occ.prefills,
            "wall_s": round(wall, 2),
            "output_tokens": tokens,
        }, [r.text for r in results]

    runs: dict[str, list[dict[str, Any]]] = {"static": [], "continuous": []}
    texts: dict[str, list[list[str]]] = {"static": [], "continuous": []}
    for i in range(pairs):
        for name in ("static", "continuous")[:: 1 if i % 2 == 0 else -1]:
            row, answers = run(refill=name == "continuous")
            runs[name].append(row)
            texts[name].append(answers)
    ratios = [c["tokens_per_s"] / max(s["tokens_per_s"], 1e-9) for s, c in zip(runs["static"], runs["continuous"])]
    median = {name: _lower_median(rs, key=lambda r: r["tokens_per_s"]) for name, rs in runs.items()}
    same = sum(
        len({t[i] for mode in texts.values() for t in mode}) == 1 for i in range(len(prompts))
    )  # the same text in every run of both modes
    return {
        "hardware": hardware(),
        "model": engine.model_dir.name if engine.model_dir else "?",
        "dtype": str(engine.dtype).replace("torch.", ""),
        "prompts": len(prompts),
        "batch_size": batch_size,
        "gen_lengths": list(GEN_LENGTHS),
        "block_lengths": sorted({p.block_length for p in params}),
        "scheduling": median,
        "pairs": [
            {"static": s["tokens_per_s"], "continuous": c["tokens_per_s"], "ratio": round(r, 3)}
            for s, c, r in zip(runs["static"], runs["continuous"], ratios)
        ],
        "speedup": round(_lower_median(ratios, key=float), 3),
        "identical_answers": same,
        "answers": len(prompts),
        "commit_step": sampling_cost(engine, settings=settings),
    }


def _lower_median(values: list[Any], key: Any) -> Any:
    """The middle one by `key`, the lower of the middle two for an even count: an element of `values`, so
    a mode's row is one of its runs and the speedup one of the pairs' ratios."""
    return sorted(values, key=key)[(len(values) - 1) // 2]


def sampling_cost(
    engine: Engine, sizes: tuple[int, ...] = (1, 16, 64), repeats: int = 5, settings: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Milliseconds of one commit step (`block.commit_step`) for a batch of rows whose whole block is
    masked, at each batch size: `step_ms` with the LM head on the masked positions, `sampling_ms` without
    it (the logits given), and each per row. The hidden states are the model's own for a masked block; the
    settings are the model's defaults for a poem opening (its shipped sampling) under `settings`."""
    prompt = EvalSet.load().poems[0]["prompt"]
    params = engine.params_for(prompt, engine.params(settings or {}))
    if STRATEGIES[params.strategy].running != "block":
        return []  # the block decoders' commit step; the fast decoder's is not measured here
    plan, mask = plan_of(params), engine.tokenizer.mask_id
    W = params.block_length
    net = Net(engine.model)
    stop = torch.tensor(sorted(engine._special(params).stop_ids), device=engine.device)
    cells = []
    with torch.inference_mode():
        for B in sizes:
            block = torch.full((B, W), mask, dtype=torch.long, device=engine.device)
            h, _ = net.hidden(
                block, torch.arange(W, device=engine.device).expand(B, W), torch.ones_like(block, dtype=torch.bool)
            )
            logits = net.head(h[block == mask])
            given = SimpleNamespace(step_head=lambda logits=logits: lambda _h: logits, chunk=len(logits))
            k = torch.ones(B, dtype=torch.long, device=engine.device)
            cell: dict[str, Any] = {"batch_size": B}
            for name, head_net in (("step_ms", net), ("sampling_ms", given)):
                times = []
                for _ in range(repeats + 1):  # the first call warms up
                    t0 = time.perf_counter()
                    draws = Draws([stream_seed(b, 0, 0) for b in range(B)], engine.device)  # the rows' noise
                    commit_step(block, [h], head_net, plan, k, mask, draws, None, stop)
                    times.append(time.perf_counter() - t0)
                ms = statistics.median(times[1:]) * 1000
                cell[name] = round(ms, 3)
                cell[name.replace("_ms", "_ms_per_row")] = round(ms / B, 4)
            cells.append(cell)
    return cells


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
    if len(report["pairs"]) > 1:
        each = ", ".join(f"{p['ratio']:.2f}x" for p in report["pairs"])
        console.print(f"pairs (static then continuous, the order alternating): {each}; the median run of each above")
    console.print(
        f"continuous / static: {report['speedup']:.2f}x (median of the pairs); identical answers: "
        f"{report['identical_answers']} / {report['answers']} ({report['dtype']})"
    )
    for cell in report["commit_step"]:
        console.print(
            f"commit step at batch {cell['batch_size']}: {cell['step_ms']:.2f} ms with the LM head, "
            f"{cell['sampling_ms']:.2f} ms sampling alone ({cell['sampling_ms_per_row']:.3f} ms per row)"
        )
