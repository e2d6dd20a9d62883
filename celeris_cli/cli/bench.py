"""`celeris bench`: reference decoding and every fast mode side by side, the group its subcommands (the
measurements that stand on their own, in bench_only.py) hang from, the options they share, and `_emit`, the
one writer of every bench report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from ..errors import CelerisError, UsageError
from .app import (
    GRAPHS_HELP,
    QUANTIZE_HELP,
    DeviceOpt,
    DtypeOpt,
    GraphsOpt,
    QuantizeOpt,
    _json_setting,
    app,
    choice,
    fail,
)

# The flags the measurements had before they were subcommands: a user who gives one is told the new form.
MOVED = {
    "--memory": "memory",
    "--loading": "loading GB",
    "--ray-compare": "ray N",
    "--scaling": "scaling",
    "--scaling-gen": "scaling --gen-lengths",
    "--scaling-batch": "scaling --batch-sizes",
    "--workload": "workload mixed",
    "--invariance": "invariance N",
    "--invariance-cost": "invariance-cost B,B,...",
    "--sweep": "sweep N,N,...",
}


class BenchGroup(TyperGroup):
    """`celeris bench`'s group: refuses a flag of the old one-command form by naming its subcommand."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        for arg in args:
            flag = arg.partition("=")[0]
            if flag in MOVED:
                fail(UsageError(f"{flag} is now `celeris bench {MOVED[flag]}`"))
        return super().parse_args(ctx, args)


bench_app = typer.Typer(cls=BenchGroup, rich_markup_mode=None, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")

MODEL = typer.Option(None, "--model", "-m", help="Model folder or embedded model's name (default: the embedded model).")
PROMPTS = typer.Option(32, "--prompts", min=1, help="Held-out openings to decode.")
BATCH_SIZE = typer.Option(16, "--batch-size", min=1)
SET = typer.Option(None, "--set", help="Settings, as JSON: '{\"temperature\": 0.8}'.")
DEVICE = choice(DeviceOpt.auto, "--device")
DTYPE = choice(DtypeOpt.auto, "--dtype")
THREADS = typer.Option(None, "--threads", min=1)
OUT = typer.Option(None, "--out", help="Also write the JSON report here.")
AS_JSON = typer.Option(False, "--json", help="Print JSON only.")
STEPS = typer.Option(None, "--denoise-steps", "--steps", min=1, help="Default: gen-length.")
BLOCK_LENGTH = typer.Option(None, "--block-length", min=1, help="Default: the model's.")


@bench_app.callback(invoke_without_command=True)
def bench_cmd(
    ctx: typer.Context,
    model: Path = MODEL,
    prompts: int = typer.Option(32, "--prompts", min=1, help="Held-out poem openings to decode."),
    batch_size: int = BATCH_SIZE,
    gen_length: int = typer.Option(256, "--gen-length", min=1),
    block_length: int = BLOCK_LENGTH,
    steps: int = STEPS,
    modes: str = typer.Option(
        None,
        "--modes",
        help="Comma-separated subset of: reference, threshold, threshold+exit, prefix-cache, dual-cache "
        "(block-diffusion models: block, block-fast; Nemotron-Labs-Diffusion: ar, nemotron, nemotron-spec).",
    ),
    set_name: str = typer.Option(None, "--set", help="Settings for every mode, as JSON."),
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
    device: DeviceOpt = DEVICE,
    dtype: DtypeOpt = DTYPE,
    threads: int = THREADS,
    quantize: QuantizeOpt = choice(QuantizeOpt.none, "--quantize", help=QUANTIZE_HELP),
    cuda_graphs: GraphsOpt = choice(GraphsOpt.auto, "--cuda-graphs", help=GRAPHS_HELP),
    out: Path = OUT,
    as_json: bool = AS_JSON,
) -> None:
    """Reference decoding and every fast mode side by side: speed and quality on the same outputs. Each
    subcommand measures only its own thing, with its own options (`celeris bench SUBCOMMAND --help`)."""
    if ctx.invoked_subcommand is not None:
        given = [p.opts[0] for p in ctx.command.params if _given(ctx, p.name)]
        sub = ctx.invoked_subcommand
        if given:
            fail(UsageError(f"{', '.join(given)} before `{sub}` would be ignored: give a subcommand's options after "
                            f"it (`celeris bench {sub} --help` lists them)"))  # fmt: skip
        return
    import tempfile

    from ..engine import load_engine
    from ..measure.bench import bench, bench_queue, modes_for, render

    try:
        engine = load_engine(model, device.value, dtype.value, threads, quantize.value, cuda_graphs=cuda_graphs.value)
        table, _ = modes_for(engine)
        chosen = [m.strip() for m in modes.split(",")] if modes else None
        for m in chosen or []:
            if m not in table:
                raise UsageError(f"unknown mode {m!r} for this model (choose {', '.join(table)})")
        settings = _json_setting(set_name)
        block_length = block_length or engine.params(settings).block_length
        graphs = cuda_graphs.value
        other = load_engine(versus, device.value, dtype.value, threads, cuda_graphs=graphs) if versus else None
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


def _given(ctx: typer.Context, name: str | None) -> bool:
    source = ctx.get_parameter_source(name) if name else None
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _emit(
    report: dict[str, Any], out: Path | None, as_json: bool, render: Callable[[dict[str, Any]], None] | None
) -> None:
    """Every measurement's report: also to --out as JSON, then as JSON (--json, or a measurement without a
    table: `render` None) or rendered as a table."""
    if out is not None:
        out.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    if as_json or render is None:
        typer.echo(json.dumps(report, ensure_ascii=False))
    else:
        render(report)


def _measure(
    measure: Callable[[], dict[str, Any]],
    out: Path | None,
    as_json: bool = False,
    render: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Run one subcommand's measurement and write its report; a user error is one line and exit code."""
    try:
        report = measure()
    except CelerisError as e:
        fail(e)
    _emit(report, out, as_json, render)
