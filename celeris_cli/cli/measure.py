"""Measuring a model: `eval` for quality on held-out prompts, `bench` for speed across decoding modes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from ..errors import CelerisError, UsageError
from .app import QUANTIZE_HELP, DeviceOpt, DtypeOpt, QuantizeOpt, _json_setting, app, fail


@app.command(name="eval")
def eval_cmd(
    model: Path = typer.Option(None, "--model", "-m", help="Model folder (default: the embedded model)."),
    poems: int = typer.Option(200, "--poems", min=1, help="Held-out poem openings to complete."),
    english: int = typer.Option(100, "--english", min=0, help="Held-out English openings to complete."),
    set_name: str = typer.Option(None, "--set", help="The generation setting, as JSON: '{\"temperature\": 0.8}'."),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    no_nll: bool = typer.Option(False, "--no-nll", help="Skip the held-out NLL estimate."),
    split: str = typer.Option(
        "eval", "--split", help="eval (report) or tune (choose settings here: rows the eval split never uses)."
    ),
    samples: int = typer.Option(1, "--samples", min=1, help="Answers per opening, with seeds seed, seed+1, ..."),
    device: DeviceOpt = typer.Option(DeviceOpt.auto, "--device"),
    dtype: DtypeOpt = typer.Option(DtypeOpt.auto, "--dtype"),
    quantize: QuantizeOpt = typer.Option(QuantizeOpt.none, "--quantize", help=QUANTIZE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """Quality on a fixed held-out set: verse structure and distinct-2, NLL bound, and English word validity,
    distinct-2, repetition, empty answers and length, beside the human continuations'."""
    from ..engine import load_engine
    from ..measure.evaluate import EvalSet, evaluate

    try:
        overrides = _json_setting(set_name)
        engine = load_engine(model, device.value, dtype.value, quantize=quantize.value)
        params = engine.params(overrides)
        report = evaluate(engine, params, EvalSet.load(), poems, english, batch_size, not no_nll, split, samples)
    except CelerisError as e:
        fail(e)
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"celeris eval (held-out, {report['split']} split)")
    for col in ("figure", "value", "human"):
        table.add_column(col)
    human = report["human_reference"]
    for key in (
        "structure_rate",
        "distinct_2",
        "english_word_validity",
        "english_distinct_2",
        "english_repetition_rate",
        "english_empty_rate",
        "english_mean_words",
        "heldout_nll_per_token",
        "poems",
        "english_prompts",
        "output_tokens",
        "wall_s",
        "tokens_per_s",
        "device",
        "dtype",
    ):
        if key in report:
            v = report[key]
            h = f"{human[key]:.4f}" if key in human else ""
            table.add_row(key, f"{v:.4f}" if isinstance(v, float) else str(v), h)
    console = Console()
    console.print(table)
    console.print("settings: " + json.dumps(report["settings"]), soft_wrap=True)
    if report["english_settings"] != report["settings"]:
        console.print("English settings: " + json.dumps(report["english_settings"]), soft_wrap=True)


def _int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"{option} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{option} must be positive integers, got {text!r}")
    return values


@app.command(name="bench")
def bench_cmd(
    model: Path = typer.Option(None, "--model", "-m", help="Model folder (default: the embedded model)."),
    prompts: int = typer.Option(32, "--prompts", min=1, help="Held-out poem openings to decode."),
    batch_size: int = typer.Option(16, "--batch-size", min=1),
    gen_length: int = typer.Option(None, "--gen-length", min=1, help="Default: 256; --sweep: each model's own."),
    block_length: int = typer.Option(None, "--block-length", min=1, help="Default: the model's."),
    steps: int = typer.Option(None, "--denoise-steps", "--steps", min=1, help="Default: gen-length."),
    modes: str = typer.Option(
        None,
        "--modes",
        help="Comma-separated subset of: reference, threshold, threshold+exit, prefix-cache, dual-cache "
        "(block-diffusion models: block, block-fast; Nemotron-Labs-Diffusion: ar, nemotron, nemotron-spec).",
    ),
    set_name: str = typer.Option(None, "--set", help="Settings for every mode, as JSON."),
    sweep: str = typer.Option(
        None,
        "--sweep",
        metavar="N,N,...",
        help="Only measure: the model's default mode at these totals of denoising steps (e.g. 5,10,20,40), with "
        "quality, time, NFE and peak memory per step count, beside the same for --versus (default: celeris-tiny "
        "beside the default model).",
    ),
    no_agreement: bool = typer.Option(False, "--no-agreement", help="Skip the cache-vs-no-cache comparison."),
    versus: str = typer.Option(
        None,
        "--versus",
        metavar="MODEL",
        help="Also decode the same prompts with this model (a folder or an embedded model's name): its baseline "
        "and default mode, its own defaults otherwise (--set is not applied to it); every row's tokens/s is "
        "shown as a multiple of its baseline.",
    ),
    queue: int = typer.Option(0, "--queue", min=0, help="Also measure queue overhead with this many files."),
    invariance: int = typer.Option(
        0, "--invariance", min=0, help="Only measure: N prompts alone versus batched, share of identical answers."
    ),
    workload: str = typer.Option(
        None,
        "--workload",
        metavar="mixed",
        help="Only measure: the mixed workload (--prompts poem and English openings, answers of 16 to 256 "
        "tokens) in static batches and through the running set, side by side.",
    ),
    invariance_cost: str = typer.Option(
        None,
        "--invariance-cost",
        metavar="B,B,...",
        help="Only measure: tokens/s with --deterministic on and off, side by side, at these batch sizes (e.g. "
        "1,16,64), on --prompts mixed-length prompts (at least one full batch), and whether the answers change "
        "with the batch size.",
    ),
    ray_compare: int = typer.Option(
        0, "--ray-compare", min=0, help="Only measure: celeris batch over N prompts, local and on Ray (1, 2 actors)."
    ),
    loading: float = typer.Option(
        0,
        "--loading",
        min=0,
        metavar="GB",
        help="Only measure: peak memory while loading a random checkpoint of this many GB (written to a temp "
        "folder), in bfloat16 and float32.",
    ),
    memory: bool = typer.Option(
        False,
        "--memory",
        help="Only measure: the memory planner's estimate beside the peak a fresh process adds decoding "
        "celeris-block, celeris-tiny and random 0.5B and 1.5B-parameter checkpoints (bfloat16) to the end.",
    ),
    scaling: bool = typer.Option(
        False,
        "--scaling",
        help="Only measure: output tokens/s and peak memory of the reference and the default mode for each "
        "gen-length x batch (one batch of prompts per cell; --denoise-steps, --block-length and --set apply).",
    ),
    scaling_gen: str = typer.Option("64,256,1024", "--scaling-gen", help="--scaling: the gen-lengths."),
    scaling_batch: str = typer.Option("1,16,64", "--scaling-batch", help="--scaling: the batch sizes."),
    device: DeviceOpt = typer.Option(DeviceOpt.auto, "--device"),
    dtype: DtypeOpt = typer.Option(DtypeOpt.auto, "--dtype"),
    threads: int = typer.Option(None, "--threads", min=1),
    quantize: QuantizeOpt = typer.Option(QuantizeOpt.none, "--quantize", help=QUANTIZE_HELP),
    out: Path = typer.Option(None, "--out", help="Also write the JSON report here."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """Reference decoding and every fast mode side by side: speed and quality on the same outputs."""
    only = {
        "--memory": memory,
        "--loading": loading,
        "--ray-compare": ray_compare,
        "--scaling": scaling,
        "--workload": workload,
        "--invariance": invariance,
        "--invariance-cost": invariance_cost,
        "--sweep": sweep,
    }
    asked = [name for name, value in only.items() if value]
    if len(asked) > 1:
        fail(UsageError(f"{' and '.join(asked)} each measure only their own thing: give one of them"))
    if memory:
        from ..measure.memory import check_default, render_check

        try:
            _emit(check_default(threads or 2), out, as_json, render_check)
        except CelerisError as e:
            fail(e)
        return
    if loading:
        from ..measure.bench import hardware
        from ..measure.loading import measure_loading

        try:
            result = {"hardware": hardware(), "loading": measure_loading(loading)}
        except CelerisError as e:
            fail(e)
        _emit(result, out, True, _no_table)
        return
    import tempfile

    from ..engine import load_engine
    from ..measure.bench import bench, bench_queue, modes_for, render
    from ..measure.invariance import batch_invariance, deterministic_cost

    if ray_compare:
        import tempfile

        from ..measure.bench import bench_batch

        try:
            with tempfile.TemporaryDirectory() as tmp:
                engine_options = {"model": str(model) if model else None, "device": device.value, "dtype": dtype.value}
                result = bench_batch(ray_compare, batch_size, Path(tmp), engine_options)
        except CelerisError as e:
            fail(e)
        _emit(result, out, True, _no_table)
        return
    if scaling:
        from ..measure.scaling import render_scaling
        from ..measure.scaling import scaling as measure_scaling

        try:
            gens, batches = _int_list("--scaling-gen", scaling_gen), _int_list("--scaling-batch", scaling_batch)
            engine = load_engine(model, device.value, dtype.value, threads)
            result = measure_scaling(engine, gens, batches, block_length, steps, _json_setting(set_name))
        except CelerisError as e:
            fail(e)
        _emit(result, out, as_json, render_scaling)
        return
    if workload:
        from ..measure.scheduling import compare_scheduling, render_scheduling

        try:
            if workload != "mixed":
                raise UsageError(f"--workload must be mixed, got {workload!r}")
            engine = load_engine(model, device.value, dtype.value, threads)
            result = compare_scheduling(engine, prompts, batch_size, _json_setting(set_name))
        except CelerisError as e:
            fail(e)
        _emit(result, out, as_json, render_scheduling)
        return
    if invariance:
        try:
            engine = load_engine(model, device.value, dtype.value, threads)
            result = batch_invariance(engine, invariance, batch_size, _json_setting(set_name))
        except CelerisError as e:
            fail(e)
        _emit(result, out, True, _no_table)
        return
    if invariance_cost:
        try:
            engine = load_engine(model, device.value, dtype.value, threads)
            sizes = list(_int_list("--invariance-cost", invariance_cost))
            result = deterministic_cost(engine, sizes, prompts, _json_setting(set_name))
        except CelerisError as e:
            fail(e)
        _emit(result, out, True, _no_table)
        return
    if sweep:
        _sweep(sweep, model, versus, prompts, batch_size, gen_length, set_name, device, dtype, threads, out, as_json)
        return
    gen_length = gen_length or 256
    try:
        engine = load_engine(model, device.value, dtype.value, threads, quantize.value)
        table, _ = modes_for(engine)
        chosen = [m.strip() for m in modes.split(",")] if modes else None
        for m in chosen or []:
            if m not in table:
                raise UsageError(f"unknown mode {m!r} for this model (choose {', '.join(table)})")
        settings = _json_setting(set_name)
        block_length = block_length or engine.params(settings).block_length
        other = load_engine(versus, device.value, dtype.value, threads) if versus else None
        report = bench(
            engine,
            prompts,
            batch_size,
            gen_length,
            block_length,
            steps,
            chosen,
            settings,
            cache_agreement=not no_agreement,
            versus=other,
        )
        if queue:
            params = engine.params({**settings, "gen_length": gen_length, "block_length": block_length})
            with tempfile.TemporaryDirectory() as tmp:
                report["queue"] = bench_queue(engine, queue, batch_size, params, Path(tmp))
    except CelerisError as e:
        fail(e)

    def render_bench(report: dict[str, Any]) -> None:
        render(report)
        if "queue" in report:
            typer.echo("queue: " + json.dumps(report["queue"]))

    _emit(report, out, as_json, render_bench)


def _no_table(report: dict[str, Any]) -> None:
    raise AssertionError("a measurement without a table prints JSON")


def _sweep(
    steps: str,
    model: Path | None,
    versus: str | None,
    prompts: int,
    batch_size: int,
    gen_length: int | None,
    set_name: str | None,
    device: DeviceOpt,
    dtype: DtypeOpt,
    threads: int | None,
    out: Path | None,
    as_json: bool,
) -> None:
    """`bench --sweep`: the model (and the one beside it) at each total of denoising steps."""
    from ..engine import DEFAULT_MODEL, load_engine
    from ..measure.sweep import render_sweep, step_sweep

    try:
        counts = list(_int_list("--sweep", steps))
        beside = versus or ("celeris-tiny" if model is None or str(model) == DEFAULT_MODEL else None)
        names = [model, *([beside] if beside else [])]
        engines = [load_engine(m, device.value, dtype.value, threads) for m in names]
        report = step_sweep(engines, counts, prompts, batch_size, gen_length, _json_setting(set_name))
    except CelerisError as e:
        fail(e)
    _emit(report, out, as_json, render_sweep)


def _emit(report: dict[str, Any], out: Path | None, as_json: bool, render: Callable[[dict[str, Any]], None]) -> None:
    """Every measurement's report: also to --out as JSON, then as JSON (--json) or rendered as a table (the
    measurements without a table always print JSON)."""
    if out is not None:
        out.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False))
    else:
        render(report)
