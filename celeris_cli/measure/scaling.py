"""`celeris bench scaling`: how output tokens/s grows with the batch, for every mode a model decodes in, against
decoding the same network left to right, over generation lengths x batch sizes.

Each cell decodes one batch of held-out poem openings (as many as the batch holds, the same openings in the
same order in every cell) with the model's settings at that gen_length, `repeats` times per mode, the modes
one after the other (their order reversed every other time), and keeps each mode's median run by tokens/s
(a cell is a few seconds at most: on a shared machine one run can move a ratio by a third). The yardstick
is the real AR decode where the model has an AR mode (`ar`: Nemotron-Labs-Diffusion,
a model trained with `--ar-weight`), else the timing of one position per row per forward against a KV cache
(`autoregressive_limit`, whose text means nothing). Per mode: tokens/s, its ratio to the yardstick, tokens
per forward, positions computed per output token, draft acceptance (speculative modes: draft tokens the AR
mode confirmed, of those verified) and peak memory. Before the cells, each mode decodes four openings at
each gen_length untimed: the first forwards' one-time costs, and for self-speculation what drafting yields,
which the engine keeps across decodes (`decode.pace.Learned`) as a long job would have learnt it. Per mode
over the run: whether each opening got the same answer in every cell (rule 2: an answer does not depend on
its batch mates or the batch's width) and, for the exact modes, whether it is the AR mode's. A cell whose
prompt plus gen_length does not fit the model's context is reported as skipped, with the reason, not left
out silently. `plot` draws tokens/s against the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import Engine
from ..errors import UsageError
from ..params import honoured
from .bench import autoregressive_limit, hardware, modes_for, run_mode
from .evaluate import EvalSet

GEN_LENGTHS = (64, 256, 1024)
BATCHES = (1, 4, 16, 64)
EXACT = ("spec", "spec-always", "nemotron-spec")  # modes whose answer is the AR mode's token for token
MAX_REPEATS = 20
KEPT = ("tokens_per_s", "wall_s", "nfe", "output_tokens", "tokens_per_forward", "positions_per_output_token")


def _modes(engine: Engine, settings: dict[str, Any] | None) -> tuple[dict[str, dict[str, Any]], str, str]:
    """(mode -> its settings, the default mode, the yardstick's name)."""
    table, default = modes_for(engine, settings)
    if "ar" in table:
        modes = dict(table)
        if "spec" in modes:  # drafting every round, beside the per-round choice
            modes["spec-always"] = {"strategy": "spec", "drafting": "always"}
        return modes, default, "ar"
    return dict(table), default, "ar-limit"


def scaling(
    engine: Engine,
    gen_lengths: tuple[int, ...] = GEN_LENGTHS,
    batches: tuple[int, ...] = BATCHES,
    block_length: int | None = None,
    steps: int | None = None,
    settings: dict[str, Any] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    if not 1 <= repeats <= MAX_REPEATS:
        raise UsageError(f"--repeats must be 1 to {MAX_REPEATS}, got {repeats}")
    modes, default_mode, yardstick = _modes(engine, settings)
    seeded = yardstick == "ar"
    poems = [r["prompt"] for r in EvalSet.load().poems]
    if any(m.get("strategy") == "spec" for m in modes.values()):
        engine.forward_cost()  # calibrated once, before anything is timed
    for mode in modes.values():  # each mode once, untimed: the first forwards, and what drafting yields (kept)
        for gen_length in gen_lengths:
            warm = _params(engine, {**(settings or {}), **mode}, gen_length, block_length, steps, seeded)
            if len(engine.encode_prompt(poems[0])) + gen_length <= engine.max_length:
                run_mode(engine, poems[:4], warm, 4)
    cells: list[dict[str, Any]] = []
    answers: dict[str, dict[tuple[int, int], str]] = {m: {} for m in modes}  # mode -> (gen, opening) -> text
    same: dict[str, bool] = {m: True for m in modes}
    as_ar: dict[str, bool] = {m: True for m in modes if m in EXACT}
    for gen_length in gen_lengths:
        for batch in batches:
            prompts = [poems[i % len(poems)] for i in range(batch)]
            longest = max(len(engine.encode_prompt(p)) for p in prompts)
            cell: dict[str, Any] = {"gen_length": gen_length, "batch": batch}
            if longest + gen_length > engine.max_length:
                cell["skipped"] = f"prompt {longest} + gen_length {gen_length} > context {engine.max_length}"
                cells.append(cell)
                continue
            cell["modes"] = {}
            texts: dict[str, list[str]] = {}
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
            for rep in range(repeats):  # the modes one after the other, their order reversed every other time
                for name in list(modes)[:: 1 if rep % 2 == 0 else -1]:
                    mode = modes[name]
                    params = _params(engine, {**(settings or {}), **mode}, gen_length, block_length, steps, seeded)
                    drafted, accepted = engine.drafted, engine.accepted
                    r = run_mode(engine, prompts, params, batch)
                    texts[name] = r.pop("texts")
                    row = {k: r[k] for k in (*KEPT, "peak_mem_mb")}
                    if engine.drafted > drafted:
                        row["draft_acceptance"] = round((engine.accepted - accepted) / (engine.drafted - drafted), 3)
                    runs[name].append(row)
                    for i, text in enumerate(texts[name]):
                        seen = answers[name].setdefault((gen_length, i), text)
                        same[name] = same[name] and seen == text
            for name, rows in runs.items():  # the median run by tokens/s (the lower one of an even count)
                cell["modes"][name] = sorted(rows, key=lambda x: x["tokens_per_s"])[(len(rows) - 1) // 2]
            if not seeded:
                limit = autoregressive_limit(engine, batch, batch, longest, gen_length)
                cell["modes"]["ar-limit"] = {k: limit[k] for k in ("tokens_per_s", "wall_s", "nfe", "output_tokens")}
            ar = cell["modes"][yardstick]["tokens_per_s"]
            for row in cell["modes"].values():
                row["x_ar"] = round(row["tokens_per_s"] / ar, 2) if ar else None
            for name in as_ar:
                as_ar[name] = as_ar[name] and texts[name] == texts["ar"]
            cells.append(cell)
    return {
        "hardware": hardware(),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "model": str(engine.model_dir),
        "default_mode": default_mode,
        "yardstick": yardstick,
        "modes": [*modes, *([] if seeded else ["ar-limit"])],
        "steps": "the model's" if steps is None else steps,
        "repeats": repeats,
        "cells": cells,
        "same_answers_in_every_cell": same,
        "the_ar_modes_answers": as_ar,
    }


def _params(
    engine: Engine,
    layer: dict[str, Any],
    gen_length: int,
    block_length: int | None,
    steps: int | None,
    seeded: bool,
) -> Any:
    """A mode's settings at this gen_length, with the block length and steps where the mode honours them
    (block diffusion: steps per block; the others: steps in total, one token per step unless given, except
    a model with an AR mode, whose modes keep their own)."""
    strategy = layer.get("strategy", engine.arch.default_strategy)
    knobs = honoured(strategy)
    layer = {**layer, "gen_length": gen_length}
    if block_length and "block_length" in knobs:
        layer["block_length"] = block_length
    if "block_steps" in knobs and not seeded:
        if steps:
            layer["block_steps"] = steps
    elif "denoise_steps" in knobs and (steps or not seeded):
        layer["denoise_steps"] = min(steps or gen_length, gen_length)
    return engine.params({k: v for k, v in layer.items() if k in knobs or k == "strategy"})


def render_scaling(report: dict[str, Any]) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 10_000)
    hw = report["hardware"]
    console.print(
        f"[bold]celeris bench scaling[/] {hw['cpu']} ({hw['cores']} cores, {hw['threads']} threads), torch "
        f"{hw['torch']}, {report['device']} {report['dtype']}, steps {report['steps']}, default mode "
        f"{report['default_mode']}, x {report['yardstick']} = tokens/s over the {report['yardstick']} row's"
        + (f", the median of {report['repeats']} runs per cell" if report.get("repeats", 1) > 1 else "")
    )
    table = Table()
    for c in ("gen_length", "batch", "mode", "tok/s", f"x {report['yardstick']}", "tok/forward", "pos/token"):
        table.add_column(c, justify="right")
    table.add_column("acceptance", justify="right")
    for cell in report["cells"]:
        if "skipped" in cell:
            table.add_row(str(cell["gen_length"]), str(cell["batch"]), cell["skipped"], *[""] * 5)
            continue
        for name, m in cell["modes"].items():
            table.add_row(
                str(cell["gen_length"]),
                str(cell["batch"]),
                f"[bold]{name}[/]" if name == report["default_mode"] else name,
                f"{m['tokens_per_s']:.1f}",
                f"{m['x_ar']}",
                str(m.get("tokens_per_forward", "")),
                str(m.get("positions_per_output_token", "")),
                str(m.get("draft_acceptance", "")),
            )
    console.print(table)
    console.print(f"same answers in every cell: {report['same_answers_in_every_cell']}")
    if report["the_ar_modes_answers"]:
        console.print(f"the AR mode's answers: {report['the_ar_modes_answers']}")


def plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s against the batch size, one line per mode and one panel per gen_length: SVG (written here,
    no dependency) or PNG (matplotlib)."""
    series = _series(report)
    if not series:
        raise UsageError("no cell was measured: nothing to plot")
    suffix = path.suffix.lower()
    if suffix == ".svg":
        path.write_text(_svg(series, report), encoding="utf-8")
    elif suffix == ".png":
        _png(series, report, path)
    else:
        raise UsageError(f"--plot {path}: give a .svg or .png file")


def _series(report: dict[str, Any]) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """gen_length -> mode -> [(batch, tokens/s)] over the measured cells."""
    out: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for cell in report["cells"]:
        for name, m in cell.get("modes", {}).items():
            out.setdefault(cell["gen_length"], {}).setdefault(name, []).append((cell["batch"], m["tokens_per_s"]))
    return out


_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def _svg(series: dict[int, dict[str, list[tuple[int, float]]]], report: dict[str, Any]) -> str:
    import math

    W, H, pad_l, pad_b, pad_t, pad_r = 460, 320, 64, 44, 34, 16
    names = list(dict.fromkeys(n for modes in series.values() for n in modes))
    parts: list[str] = []
    for p, (gen, modes) in enumerate(sorted(series.items())):
        x0 = p * W
        batches = sorted({b for pts in modes.values() for b, _ in pts})
        top = max(v for pts in modes.values() for _, v in pts) * 1.1 or 1.0
        lo, hi = math.log2(batches[0]), math.log2(batches[-1]) if len(batches) > 1 else math.log2(batches[0]) + 1

        def sx(b: int, lo: float = lo, hi: float = hi, x0: int = x0) -> float:
            return x0 + pad_l + (math.log2(b) - lo) / (hi - lo or 1) * (W - pad_l - pad_r)

        def sy(v: float, top: float = top) -> float:
            return pad_t + (1 - v / top) * (H - pad_t - pad_b)

        parts.append(f'<text x="{x0 + W / 2}" y="20" text-anchor="middle" font-size="14">gen_length {gen}</text>')
        parts.append(
            f'<polyline points="{x0 + pad_l},{pad_t} {x0 + pad_l},{H - pad_b} {x0 + W - pad_r},{H - pad_b}" '
            'fill="none" stroke="#333"/>'
        )
        for i in range(5):
            v = top * i / 4
            parts.append(
                f'<text x="{x0 + pad_l - 6}" y="{sy(v) + 4:.1f}" text-anchor="end" font-size="11">{v:.0f}</text>'
            )
            parts.append(
                f'<line x1="{x0 + pad_l}" y1="{sy(v):.1f}" x2="{x0 + W - pad_r}" y2="{sy(v):.1f}" stroke="#ddd"/>'
            )
        for b in batches:
            parts.append(f'<text x="{sx(b):.1f}" y="{H - pad_b + 16}" text-anchor="middle" font-size="11">{b}</text>')
        parts.append(f'<text x="{x0 + W / 2}" y="{H - 8}" text-anchor="middle" font-size="12">batch size (rows)</text>')
        parts.append(
            f'<text x="{x0 + 14}" y="{H / 2}" font-size="12" transform="rotate(-90 {x0 + 14} {H / 2})" '
            'text-anchor="middle">output tokens/s</text>'
        )
        for name, pts in modes.items():
            colour = _COLOURS[names.index(name) % len(_COLOURS)]
            dash = ' stroke-dasharray="5,3"' if name in ("ar", "ar-limit") else ""
            xy = " ".join(f"{sx(b):.1f},{sy(v):.1f}" for b, v in sorted(pts))
            parts.append(f'<polyline points="{xy}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
            for b, v in pts:
                parts.append(f'<circle cx="{sx(b):.1f}" cy="{sy(v):.1f}" r="3" fill="{colour}"/>')
    legend_y = H + 8
    for i, name in enumerate(names):
        colour = _COLOURS[i % len(_COLOURS)]
        x = 20 + i * 130
        label = f"{name} (default)" if name == report["default_mode"] else name
        parts.append(f'<rect x="{x}" y="{legend_y}" width="14" height="4" fill="{colour}"/>')
        parts.append(f'<text x="{x + 20}" y="{legend_y + 7}" font-size="12">{label}</text>')
    width, height = W * len(series), H + 30
    body = "\n".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">\n'
        f'<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n'
    )


def _png(series: dict[int, dict[str, list[tuple[int, float]]]], report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("a PNG plot needs matplotlib (pip install '.[plot]'); an .svg needs nothing") from None
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4), squeeze=False)
    for ax, (gen, modes) in zip(axes[0], sorted(series.items())):
        for name, pts in modes.items():
            pts = sorted(pts)
            style = "--" if name in ("ar", "ar-limit") else "-"
            label = f"{name} (default)" if name == report["default_mode"] else name
            ax.plot([b for b, _ in pts], [v for _, v in pts], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"gen_length {gen}")
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
