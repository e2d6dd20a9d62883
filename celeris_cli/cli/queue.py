"""The queue's commands: `watch` serves a spool folder, `retry` runs failures again, `status` reports."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer

from ..errors import EXIT_IO, EXIT_LOCKED, EXIT_OK, CelerisError, UsageError
from .app import app, fail


def _load_batch_config(config: Path) -> Any:
    from ..spool.config import load_config

    return load_config(config)


def _spool(cfg: Any, progress: Any = None, hooks: bool = False) -> Any:
    """The queue's daemon; with `hooks`, it says on stderr when it is up and watching and what a stop whose
    grace ran out kept claimed."""
    from ..spool.daemon import Spool

    def backend() -> Any:
        if cfg.engine.ray is not None:  # batches on Ray actors; the queue itself stays here
            from ..batch.ray_actors import RayActorPool

            return RayActorPool(cfg)
        from ..spool.backend import EngineBackend

        return EngineBackend(
            cfg.model, cfg.device, cfg.dtype, cfg.threads, cfg.generation, cfg.quantize, cfg.max_memory,
            cfg.cuda_graphs,
        )  # fmt: skip

    if not hooks:
        return Spool(cfg, backend, progress=progress)
    return Spool(cfg, backend, progress=progress, on_watching=_watching, on_expired=_expired)


def _watching(spool: Any) -> None:
    resumed = f"; {plural(len(spool.claimed), 'claimed file')} to resume" if spool.claimed else ""
    typer.echo(
        f"celeris watch: watching {spool.f.inputs} (model {spool.cfg.model or 'embedded default'}, "
        f"pid {os.getpid()}){resumed}",
        err=True,
    )


def _expired(spool: Any, kept: Any) -> None:
    """Said from the grace thread just before the process exits."""
    import sys

    in_flight = sum(k.in_flight for k in kept)
    files = ", ".join(f"{k.file} ({k.in_flight} in flight)" for k in kept[:5]) + (", ..." if len(kept) > 5 else "")
    typer.echo(
        f"celeris watch: shutdown_grace_s ({spool.cfg.shutdown_grace_s:g} s) ran out; kept claimed "
        f"{plural(len(kept), 'file')}" + (f": {files}" if kept else "") + f"; {plural(in_flight, 'request')} were in "
        "flight. They resume on the next start (a stop never counts against a request).",
        err=True,
    )
    sys.stderr.flush()


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def summary_line(counts: Any, seconds: float, blocked: bool = False) -> str:
    """The one line `watch --once` ends with, for cron logs."""
    quarantined = f" ({counts.quarantined} quarantined)" if counts.quarantined else ""
    return (
        f"celeris watch --once: {plural(counts.files, 'file')}{quarantined}, {plural(counts.results, 'result')}, "
        f"{plural(counts.failures, 'failure')} in {seconds:.1f} s"
        + (", publishing blocked: files kept claimed for the next run" if blocked else "")
    )


def _serve(
    cfg: Any, once: bool, quiet: bool = True, summary: bool = False, locked_ok: bool = False, exit_now: bool = False
) -> int | None:
    """Run the queue; the exit code. With `locked_ok`, None when another instance holds the queue. With
    `exit_now`, a daemon stopped by a signal says so and leaves the process at once: everything is on
    disk by then, and the interpreter's teardown of torch alone takes seconds."""
    import signal
    import sys
    import time

    from ..spool.fsutil import LockHeld

    spool = _spool(cfg, None if quiet else lambda line: typer.echo(line, err=True), hooks=exit_now)
    t0 = time.monotonic()
    try:
        code = int(spool.run(once=once))
    except LockHeld as e:
        if locked_ok:
            return None
        typer.echo(f"Error: another celeris instance holds the queue lock ({e.holder}); exiting", err=True)
        raise typer.Exit(EXIT_LOCKED) from None
    if summary:  # one line for cron logs, even with --quiet
        typer.echo(summary_line(spool.counts, time.monotonic() - t0, blocked=code == EXIT_IO), err=True)
    if spool.stop_signal is not None:
        c = spool.counts
        typer.echo(
            f"celeris watch: stopped on {signal.Signals(spool.stop_signal).name} "
            f"({plural(c.files, 'file')}, {plural(c.results, 'result')}, {plural(c.failures, 'failure')} this run)",
            err=True,
        )
        if exit_now:
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


@app.command()
def watch(
    config: Path = typer.Argument(..., metavar="CONFIG", help="The queue's YAML config, e.g. configs/batch.yaml."),
    once: bool = typer.Option(False, "--once", help="Drain the queue and exit (for cron)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No line per batch on stderr."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also log details to stderr."),
) -> None:
    """Serve a spool folder: prompt files in, results out. Prints a line per batch to stderr, and with
    --once a summary line. Exit codes: 0 done, 1 failures recorded (--once), 2 usage, config or model
    error, 74 (--once) a claim or publish is refused by the filesystem (files stay in the inbox or claimed),
    75 another instance holds the lock."""
    import logging

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(message)s")
    try:
        code = _serve(_load_batch_config(config), once, quiet=quiet, summary=once, exit_now=True)
    except CelerisError as e:
        fail(e)
    raise typer.Exit(code or EXIT_OK)


@app.command()
def retry(
    log: Path = typer.Argument(..., metavar="LOG", help="The failure log, e.g. logs/failed.jsonl."),
    config: Path = typer.Option(Path("configs/batch.yaml"), "--config", "-c", help="The queue's config."),
    include_all: bool = typer.Option(
        False, "--all", help="Also retry records marked not retryable, except line-level user errors."
    ),
    force: bool = typer.Option(
        False, "--force", help="Retry every record, even line-level user errors (a bad line fails again)."
    ),
    no_run: bool = typer.Option(False, "--no-run", help="Only queue the retries; do not drain the queue."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Run failed requests again: queue them as a new input file, then drain the queue once."""
    from ..spool.folders import queue_lock
    from ..spool.ops import plan_retry

    try:
        if not log.is_file():
            raise UsageError(f"failure log not found: {log}")
        if not config.is_file():  # the default, configs/batch.yaml, is relative to where retry runs
            raise UsageError(f"{config}: config file not found; name the queue's config with -c/--config")
        cfg = _load_batch_config(config)
        report = plan_retry(cfg, log, include_all, force)
        for warning in report.details:
            typer.echo(f"Warning: {warning}", err=True)
        ran = "not run"
        code: int | None = EXIT_OK
        if report.resubmitted and not no_run:
            code = _serve(cfg, once=True, locked_ok=True) if queue_lock(cfg).holder() is None else None
            ran = "ran now" if code is not None else "queued for the running daemon"
    except CelerisError as e:
        fail(e)
    summary = {**report.to_dict(), "run": ran}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(
            f"resubmitted {report.resubmitted} ({ran}); skipped: {report.already_retried} already retried, "
            f"{report.already_done} already have a result, "
            f"{report.not_retryable} not retryable, {report.user_errors} line-level user errors, "
            f"{report.out_of_attempts} out of attempts, {report.no_request} without a request, "
            f"{report.malformed} malformed" + (f"; file {report.file}" if report.file else "")
        )
    raise typer.Exit(code or EXIT_OK)


@app.command()
def status(
    config: Path = typer.Argument(Path("configs/batch.yaml"), metavar="CONFIG", help="The queue's config."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Counts per folder, the oldest pending file, the lock holder and the last heartbeat."""
    from ..spool.ops import status as queue_status

    try:
        info = queue_status(_load_batch_config(config))
    except CelerisError as e:
        fail(e)
    if as_json:
        typer.echo(json.dumps(info))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"queue {info['root']}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for k, v in info["counts"].items():
        table.add_row(k, str(v))
    oldest = info["oldest_pending_age_s"]
    table.add_row("oldest pending (s)", "-" if oldest is None else str(oldest))  # "-": nothing to report
    table.add_row("lock holder", str(info["lock_holder"] or "-"))
    hb = info["heartbeat"]
    table.add_row("last heartbeat", f"{hb['state']} {hb['age_s']}s ago (pid {hb['pid']})" if hb else "-")
    last = hb.get("last_batch_age_s") if hb else None
    table.add_row("last batch", f"{last}s ago" if last is not None else "-")
    peak = hb.get("peak_memory_mb") if hb else None
    table.add_row("last batch's peak memory", f"{peak} MiB" if peak else "-")
    Console().print(table)
