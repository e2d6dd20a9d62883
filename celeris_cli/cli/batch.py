"""`celeris batch`: one file of requests to results, locally or on Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..errors import EXIT_FAILED, EXIT_OK, CelerisError
from .app import GRAPHS_HELP, DeviceOpt, DtypeOpt, GraphsOpt, _json_setting, app, choice, fail


def _optional_ray_address(argv: list[str]) -> list[str]:
    """`--ray` may stand alone (a local Ray for the run); Click options cannot take an optional value, so a
    bare `--ray` is given the value `local` here."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--ray" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("local")
    return out


@app.command(name="batch")
def batch_cmd(
    input_file: Path = typer.Option(..., "--input", "-i", help="Requests, one per line: .jsonl or .txt."),
    output: Path = typer.Option(..., "--output", "-o", help="Results, one line per request, in input order."),
    failed: Path = typer.Option(None, "--failed", help="Failure records (default: OUTPUT.failed.jsonl)."),
    model: Path = typer.Option(None, "--model", "-m", help="Model folder (default: the embedded model)."),
    set_name: str = typer.Option(None, "--set", help="Settings for every request, as JSON; requests override."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Prompts decoded together."),
    ray: str = typer.Option(
        None, "--ray", help="Run on Ray: alone for a local Ray, or an address (auto, ray://host:10001)."
    ),
    actors: int = typer.Option(1, "--actors", min=1, help="Ray: actors, each with the model loaded once."),
    cpus_per_actor: float = typer.Option(None, "--cpus-per-actor", min=0.0, help="Ray: CPUs per actor."),
    gpus_per_actor: float = typer.Option(0.0, "--gpus-per-actor", min=0.0, help="Ray: GPUs per actor."),
    device: DeviceOpt = choice(DeviceOpt.auto, "--device"),
    dtype: DtypeOpt = choice(DtypeOpt.auto, "--dtype"),
    cuda_graphs: GraphsOpt = choice(GraphsOpt.auto, "--cuda-graphs", help=GRAPHS_HELP),
    restart: bool = typer.Option(
        False, "--restart", help="Discard the journal of an interrupted run (OUTPUT.celeris-journal) and start over."
    ),
) -> None:
    """Run one file of requests (like `vllm run-batch`): results in input order, failures as records.
    Each finished batch is journaled beside OUTPUT, so the same command after a crash resumes.
    Exit codes: 0 all done, 1 some requests failed (see --failed), 2 usage error."""
    from ..batch import run_file
    from .progress import Progress, interrupt_code, interrupted, sigterm_interrupts

    failed = failed or output.with_name(output.name + ".failed.jsonl")
    try:
        settings = _json_setting(set_name)
        from ..params import check_values

        check_values(settings)
        engine = {"model": str(model) if model else None, "device": device.value, "dtype": dtype.value,
                  "cuda_graphs": cuda_graphs.value, "generation": settings}  # fmt: skip
        if ray is None:
            from ..batch.local import LocalExecutor
            from ..spool.backend import EngineBackend

            backend = EngineBackend(
                engine["model"], device.value, dtype.value, None, settings, cuda_graphs=cuda_graphs.value
            )
            executor: Any = LocalExecutor(backend, batch_size)
        else:
            from ..batch.ray_pool import RayExecutor, RayOptions

            address = None if ray == "local" else ray
            executor = RayExecutor(
                RayOptions(
                    address=address,
                    actors=actors,
                    cpus_per_actor=cpus_per_actor,
                    gpus_per_actor=gpus_per_actor,
                    batch_size=batch_size,
                    engine=engine,
                )
            )

        # answers (results and failures) of every line of the input, counted from the first report
        def resumed(n: int) -> None:  # said first, before the bar: what this run will not do again
            typer.echo(f"resumed: {n} requests were finished by an interrupted run", err=True)

        with sigterm_interrupts(), Progress(0, quiet=False, label="batch") as progress:
            # what decides the answers (local and Ray give the same ones, so the executor is not in it)
            key = {**engine, "model": str(model.resolve()) if model else None, "batch_size": batch_size}
            report = run_file(input_file, output, failed, executor, progress.report, key, restart, resumed)
    except CelerisError as e:
        fail(e)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`sigterm_interrupts`)
        from ..batch.journal import journal_path

        typer.echo(
            f"{interrupted(e)}: finished batches are kept in {journal_path(output)}; "
            "run the same command again to resume",
            err=True,
        )
        raise typer.Exit(interrupt_code(e)) from None
    typer.echo(
        f"{report.results} results, {report.failures} failures of {report.requests} requests in "
        f"{report.wall_s:.1f}s ({report.prompts_per_s} prompts/s) -> {report.output}"
        + (f", failures in {report.failed}" if report.failures else ""),
        err=True,
    )
    raise typer.Exit(EXIT_FAILED if report.failures else EXIT_OK)
