"""`celeris bench`'s subcommands: each measures only its own thing (memory, loading, ray, scaling, workload,
invariance, invariance-cost, sweep, structured), takes only the options that mean something to it, and writes
its report through bench's one writer (`_measure` -> `_emit`). Registered on `bench_app` when imported."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import typer

from ..errors import UsageError
from .app import DeviceOpt, DtypeOpt, _json_setting, fail
from .bench import (
    AS_JSON,
    BATCH_SIZE,
    BLOCK_LENGTH,
    DEVICE,
    DTYPE,
    MODEL,
    OUT,
    PROMPTS,
    SET,
    THREADS,
    _measure,
    bench_app,
)


def _int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"{name} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{name} must be positive integers, got {text!r}")
    return values


@bench_app.command(name="memory")
def memory_cmd(
    threads: int = typer.Option(2, "--threads", min=1, help="Torch threads in each measuring process."),
    out: Path = OUT,
    as_json: bool = AS_JSON,
) -> None:
    """The memory planner's estimate beside the peak a fresh process adds decoding celeris-block,
    celeris-tiny and random 0.5B and 1.5B-parameter checkpoints (bfloat16) to the end, and the 0.5B one
    (float32) predicting a 256-token block at once, greedy and sampled."""
    from ..measure.memory import check_default, render_check

    _measure(lambda: check_default(threads), out, as_json, render_check)


@bench_app.command(name="loading")
def loading_cmd(
    gb: float = typer.Argument(..., metavar="GB", help="The random checkpoint's size in GB."),
    out: Path = OUT,
) -> None:
    """Peak memory while loading a random checkpoint of GB gigabytes (written to a temporary folder), in
    bfloat16 and float32. Prints JSON."""
    from ..measure.bench import hardware
    from ..measure.loading import measure_loading

    if not gb > 0:
        fail(UsageError(f"GB must be more than 0, got {gb}"))
    _measure(lambda: {"hardware": hardware(), "loading": measure_loading(gb)}, out)


@bench_app.command(name="ray")
def ray_cmd(
    n: int = typer.Argument(..., min=1, metavar="N", help="Prompts in the file."),
    model: Path = MODEL,
    batch_size: int = BATCH_SIZE,
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    out: Path = OUT,
) -> None:
    """`celeris batch` over one file of N held-out prompts, local and on Ray (1, 2 actors): wall time,
    prompts/s, and whether every text equals the local run's. Prints JSON. Needs ray."""
    import tempfile

    from ..measure.bench import bench_batch

    def measure() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            options = {"model": str(model) if model else None, "device": device.value, "dtype": dtype.value}
            return bench_batch(n, batch_size, Path(tmp), options)

    _measure(measure, out)


@bench_app.command(name="scaling")
def scaling_cmd(
    model: Path = MODEL,
    gen_lengths: str = typer.Option("64,256,1024", "--gen-lengths", metavar="N,N,...", help="The gen-lengths."),
    batch_sizes: str = typer.Option("1,4,16,64", "--batch-sizes", metavar="B,B,...", help="The batch sizes."),
    block_length: int = BLOCK_LENGTH,
    steps: int = typer.Option(
        None,
        "--denoise-steps",
        "--steps",
        min=1,
        help="Default: the model's (gen-length for a model without an AR mode).",
    ),
    set_name: str = SET,
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    threads: int = THREADS,
    plot: Path = typer.Option(
        None, "--plot", metavar="FILE", help="Also draw tokens/s against the batch size per mode: FILE.svg or FILE.png."
    ),
    repeats: int = typer.Option(
        1, "--repeats", min=1, max=20, help="Decodes per mode and cell, the modes alternating; the median is kept."
    ),
    out: Path = OUT,
    as_json: bool = AS_JSON,
) -> None:
    """Output tokens/s of every mode the model decodes in, against decoding it left to right, for each
    gen-length x batch size (one batch of poem openings per cell): tokens per forward, positions per output
    token, draft acceptance, and whether every answer is the same at every width."""
    from ..engine import load_engine
    from ..measure.scaling import plot as draw
    from ..measure.scaling import render_scaling, scaling

    if plot is not None and plot.suffix.lower() not in (".svg", ".png"):
        fail(UsageError(f"--plot {plot}: give a .svg or .png file"))
    if plot is not None and plot.suffix.lower() == ".png":  # before the measurement, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail(UsageError(f"--plot {plot}: a PNG needs matplotlib (pip install '.[plot]'); an .svg needs nothing"))

    def measure() -> dict[str, Any]:
        gens, batches = _int_list("--gen-lengths", gen_lengths), _int_list("--batch-sizes", batch_sizes)
        engine = load_engine(model, device.value, dtype.value, threads)
        report = scaling(engine, gens, batches, block_length, steps, _json_setting(set_name), repeats)
        if plot is not None:
            draw(report, plot)
        return report

    _measure(measure, out, as_json, render_scaling)


class WorkloadOpt(str, Enum):
    mixed = "mixed"


@bench_app.command(name="workload")
def workload_cmd(
    kind: WorkloadOpt = typer.Argument(
        WorkloadOpt.mixed, metavar="WORKLOAD", help="mixed: poem and English openings, answers of 16 to 256 tokens."
    ),  # fmt: skip
    model: Path = MODEL,
    prompts: int = PROMPTS,
    batch_size: int = BATCH_SIZE,
    set_name: str = SET,
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    threads: int = THREADS,
    pairs: int = typer.Option(
        1, "--pairs", min=1, help="Static and continuous runs, this many of each, alternating which goes first."
    ),
    out: Path = OUT,
    as_json: bool = AS_JSON,
) -> None:
    """One workload decoded in static batches and through the running set, side by side: output tokens/s,
    occupancy, NFE, and how many answers are identical."""
    from ..engine import load_engine
    from ..measure.scheduling import compare_scheduling, render_scheduling

    def measure() -> dict[str, Any]:
        engine = load_engine(model, device.value, dtype.value, threads)
        return compare_scheduling(engine, prompts, batch_size, _json_setting(set_name), pairs)

    _measure(measure, out, as_json, render_scheduling)


@bench_app.command(name="invariance")
def invariance_cmd(
    n: int = typer.Argument(..., min=1, metavar="N", help="Held-out openings of mixed lengths."),
    model: Path = MODEL,
    batch_size: int = BATCH_SIZE,
    set_name: str = SET,
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    threads: int = THREADS,
    out: Path = OUT,
) -> None:
    """N prompts decoded alone and in batches: the share of identical answers. Prints JSON."""
    from ..engine import load_engine
    from ..measure.invariance import batch_invariance

    def measure() -> dict[str, Any]:
        engine = load_engine(model, device.value, dtype.value, threads)
        return batch_invariance(engine, n, batch_size, _json_setting(set_name))

    _measure(measure, out)


@bench_app.command(name="invariance-cost")
def invariance_cost_cmd(
    sizes: str = typer.Argument(..., metavar="B,B,...", help="The batch sizes, e.g. 1,16,64."),
    model: Path = MODEL,
    prompts: int = typer.Option(32, "--prompts", min=1, help="Mixed-length openings (at least one full batch)."),
    set_name: str = SET,
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    threads: int = THREADS,
    out: Path = OUT,
) -> None:
    """Tokens/s with --deterministic on and off, side by side, at each batch size, and whether the answers
    change with the batch size. Prints JSON."""
    from ..engine import load_engine
    from ..measure.invariance import deterministic_cost

    def measure() -> dict[str, Any]:
        batch_sizes = list(_int_list("the batch sizes", sizes))
        engine = load_engine(model, device.value, dtype.value, threads)
        return deterministic_cost(engine, batch_sizes, prompts, _json_setting(set_name))

    _measure(measure, out)


@bench_app.command(name="sweep")
def sweep_cmd(
    steps: str = typer.Argument(..., metavar="N,N,...", help="Totals of denoising steps, e.g. 5,10,20,40."),
    model: Path = MODEL,
    versus: str = typer.Option(
        None,
        "--versus",
        metavar="MODEL",
        help="The model beside it, at its own defaults (default: celeris-tiny beside the default model, "
        "none beside another).",
    ),
    prompts: int = typer.Option(32, "--prompts", min=1, help="Held-out poem openings to decode."),
    batch_size: int = BATCH_SIZE,
    gen_length: int = typer.Option(None, "--gen-length", min=1, help="Default: each model's own."),
    set_name: str = typer.Option(None, "--set", help="Settings for the first model, as JSON."),
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    threads: int = THREADS,
    out: Path = OUT,
    as_json: bool = AS_JSON,
) -> None:
    """The model's default mode at each total of denoising steps, with quality, time, NFE and peak memory
    per step count, beside the same for --versus."""
    from ..engine import DEFAULT_MODEL, load_engine
    from ..measure.sweep import render_sweep, step_sweep

    def measure() -> dict[str, Any]:
        counts = list(_int_list("the step counts", steps))
        beside = versus or ("celeris-tiny" if model is None or str(model) == DEFAULT_MODEL else None)
        names: list[str | Path | None] = [model, *([beside] if beside else [])]
        engines = [load_engine(m, device.value, dtype.value, threads) for m in names]
        return step_sweep(engines, counts, prompts, batch_size, gen_length, _json_setting(set_name))

    _measure(measure, out, as_json, render_sweep)


@bench_app.command(name="structured")
def structured_cmd(
    model: Path = MODEL,
    requests: int = typer.Option(
        200, "--requests", min=1, max=10_000, help="Extraction requests, over six JSON schemas in turn."
    ),
    gen_length: int = typer.Option(
        96,
        "--gen-length",
        min=1,
        max=1024,
        help="Every answer's length (the default model's longest template takes 83 tokens).",
    ),
    batch_size: int = BATCH_SIZE,
    set_name: str = SET,
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    threads: int = THREADS,
    out: Path = OUT,
    as_json: bool = AS_JSON,
    suite: Path | None = typer.Option(
        None,
        "--suite",
        metavar="FOLDER",
        help="Instead: the JSON schemas in FOLDER (JSONSchemaBench's files), compiled as requests are admitted, "
        "beside llguidance alone, per subset, with their test instances fed to the grammar (tokenizer only).",
    ),
) -> None:
    """An extraction workload decoded unconstrained, held left to right to its JSON schema, and
    template-pinned (the schemas of a fixed shape; the others left to right), side by side: the share of
    answers that parse and that validate, finish reasons, tokens/s, forwards per answer, wall time."""
    from ..engine import load_engine
    from ..measure.structured import bench_structured, render_structured

    if suite is not None:
        from ..measure.coverage import coverage, render_coverage, vocabulary_of

        _measure(lambda: coverage(suite, vocabulary_of(model)), out, as_json, render_coverage)
        return

    def measure() -> dict[str, Any]:
        engine = load_engine(model, device.value, dtype.value, threads)
        return bench_structured(engine, requests, gen_length, batch_size, _json_setting(set_name))

    _measure(measure, out, as_json, render_structured)


@bench_app.command(name="graphs")
def graphs_cmd(
    models: list[str] = typer.Option(
        None,
        "--model",
        "-m",
        help="A model folder, an embedded model's name, or a folder of families (a folder of model folders per "
        "family, as the tests' data: one model of each); repeat for several. Default: the embedded models.",
    ),
    steps: list[str] = typer.Option(None, "--step", help="Only this step; repeat for several. Default: every step."),
    gen_length: int = typer.Option(16, "--gen-length", min=1, max=256, help="Each answer's length."),
    device: DeviceOpt = DEVICE,
    threads: int = THREADS,
    out: Path = OUT,
    as_json: bool = AS_JSON,
) -> None:
    """Each decode step (the AR step, the spec round, the cached block steps, the canvas step) on every model
    given that runs it: whether torch.compile(fullgraph=True) captures it whole, whether answers with it
    captured equal eager answers, and on CUDA its time eager and captured per batch bucket."""
    import torch

    from ..engine import embedded_models, model_dir
    from ..errors import ModelError
    from ..measure.graphs import STEPS, models_in, render, run

    def measure() -> dict[str, Any]:
        names = {s.name: s for s in STEPS}
        unknown = [s for s in steps or [] if s not in names]
        if unknown:
            raise UsageError(f"--step {unknown[0]!r} is not a step; the steps: {', '.join(names)}")
        paths = [model_dir(m) for m in models] if models else list(embedded_models().values())
        missing = [p for p in paths if not p.is_dir()]
        if missing:
            raise ModelError(f"--model {missing[0]}: no such folder or embedded model")
        found = models_in(paths)
        if not found:
            raise ModelError(f"--model {paths[0]}: holds no model folder (config.json and weights)")
        if threads:
            torch.set_num_threads(threads)
        chosen = tuple(names[s] for s in steps) if steps else STEPS
        return run(found, chosen, device.value, gen_length)

    _measure(measure, out, as_json, render)
