"""`celeris serve`: the OpenAI API over one loaded engine, and the Batch API over a queue (`--queue`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..constraints import MAX_SPEC_CHARS
from ..errors import EXIT_OK, CelerisError, UsageError
from .app import GRAPHS_HELP, DeviceOpt, DtypeOpt, GraphsOpt, app, fail


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; beyond loopback a key is needed."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to listen on."),
    model: str = typer.Option(
        None, "--model", "-m", metavar="FOLDER", help="Model folder or embedded name (default: the embedded model)."
    ),
    queue: Path = typer.Option(
        None,
        "--queue",
        metavar="CONFIG",
        help="A queue's config (configs/batch.yaml): enables /v1/files and /v1/batches, served by a "
        "`celeris watch` on the same config; the model and its settings then come from the config.",
    ),
    api_key_file: Path = typer.Option(
        None, "--api-key-file", metavar="FILE", help="API keys, one per line; requests must send one as a Bearer token."
    ),
    insecure_no_auth: bool = typer.Option(
        False, "--insecure-no-auth", help="Serve a non-loopback --host without any key (not recommended)."
    ),
    device: DeviceOpt = typer.Option(None, "--device", help="auto picks CUDA when present."),
    dtype: DtypeOpt = typer.Option(None, "--dtype", help="auto picks bfloat16 where it is fast."),
    cuda_graphs: GraphsOpt = typer.Option(None, "--cuda-graphs", help=GRAPHS_HELP + " With --queue: the config's."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, metavar="N", help="Rows decoded together at most."),
    max_tokens: int = typer.Option(
        512, "--max-tokens", min=1, metavar="N", help="Largest max_tokens a request may ask."
    ),
    max_concurrent: int = typer.Option(
        256, "--max-concurrent", min=1, metavar="N", help="Completion requests in flight at once; more get 429."
    ),
    max_body_bytes: int = typer.Option(
        1 << 20, "--max-body-bytes", min=1, metavar="N", help="Largest JSON request body; larger get 413."
    ),
    max_file_bytes: int = typer.Option(
        100 << 20, "--max-file-bytes", min=1, metavar="N", help="Largest uploaded batch file; larger get 413."
    ),
    max_batch_lines: int = typer.Option(
        50_000, "--max-batch-lines", min=1, metavar="N", help="Most request lines in an uploaded batch file."
    ),
    max_constraint_chars: int = typer.Option(
        MAX_SPEC_CHARS,
        "--max-constraint-chars",
        min=1,
        max=MAX_SPEC_CHARS,
        metavar="N",
        help="Largest constraint (structured_outputs / response_format, as compact JSON) a completion may ask; "
        "the default, 1 MiB, compiles in under 2 s (docs/structured.md).",
    ),
    threads: int = typer.Option(
        None,
        "--threads",
        min=1,
        max=1024,
        metavar="N",
        help="torch threads decoding (as the queue's `threads:`); default: the CPUs this process may use, less "
        "one for the HTTP side, or OMP_NUM_THREADS when set.",
    ),
) -> None:
    """Serve the OpenAI API (completions, chat, streaming, files, batches) on one loaded model.

    Binds 127.0.0.1 by default. Keys come from --api-key-file, never the command line. With --queue, batch
    jobs go through the queue's inbox and survive restarts of the server and of its daemon."""
    try:
        from ..serve.guard import allowed_hosts
        from ..serve.private import key_file_warning
        from ..serve.settings import Keys, Limits, check_exposure

        keys = Keys.from_file(api_key_file) if api_key_file is not None else Keys()
        if api_key_file is not None and (warning := key_file_warning(api_key_file)):
            typer.echo(warning, err=True)
        check_exposure(host, keys, insecure_no_auth)
        sizes = (max_body_bytes, max_file_bytes, max_tokens, max_batch_lines, max_concurrent, batch_size)
        limits = Limits(*sizes, max_constraint_chars)
        _check_port(host, port)
        state = _build(model, queue, device, dtype, keys, limits, threads, cuda_graphs)
        state.hosts = allowed_hosts(host)
    except CelerisError as e:
        fail(e)
    import uvicorn

    from ..serve.app import create_app

    typer.echo(f"celeris serve: {state.model_id} on http://{_url_host(host)}:{port}/v1", err=True)
    uvicorn.run(create_app(state), host=host, port=port, log_level="warning", access_log=False)
    raise typer.Exit(EXIT_OK)


def _build(
    model: str | None,
    queue: Path | None,
    device: DeviceOpt | None,
    dtype: DtypeOpt | None,
    keys: Any,
    limits: Any,
    threads: int | None,
    cuda_graphs: GraphsOpt | None = None,
) -> Any:
    from ..engine import load_engine
    from ..serve.files import FileStore
    from ..serve.runner import Runner
    from ..serve.state import ServeState

    generation: dict[str, Any] = {}
    cfg = None
    if queue is not None:
        from ..spool.config import load_config
        from ..spool.folders import create_missing

        cfg = load_config(queue)
        given = (("--model", model), ("--device", device), ("--dtype", dtype), ("--cuda-graphs", cuda_graphs))
        for flag, value in given:
            if value is not None:
                raise UsageError(f"{flag}: with --queue the model, its device and its settings come from {queue}")
        create_missing(cfg.folders, cfg.private)
        threads = threads or cfg.threads or default_threads()
        engine = load_engine(cfg.model, cfg.device, cfg.dtype, threads, cuda_graphs=cfg.cuda_graphs)
        generation = cfg.generation
    else:
        device_name, dtype_name = (device or DeviceOpt.auto).value, (dtype or DtypeOpt.auto).value
        graphs = (cuda_graphs or GraphsOpt.auto).value
        engine = load_engine(model, device_name, dtype_name, threads or default_threads(), cuda_graphs=graphs)
    model_id = engine.model_dir.name if engine.model_dir is not None else "celeris"
    runner = Runner(engine, generation, limits.batch_size, limits.max_constraint_chars)
    state = ServeState(runner, model_id, limits, keys, files=None, queue=cfg)
    import torch

    state.threads = torch.get_num_threads()
    if engine.model_dir is not None:  # /v1/models' `created`: when the model was made, not when asked
        state.created = int((engine.model_dir / "config.json").stat().st_mtime)
    runner.on_batch = state.metrics.batch_rows.observe
    if cfg is not None:
        from ..serve.batches import BatchStore

        folder = cfg.root / "serve"
        state.files = FileStore(folder / "files")
        state.batches = BatchStore(folder / "batches", cfg, state.files, model_id)
    return state


def default_threads() -> int | None:
    """torch threads when --threads is not given: the CPUs this process may run on, less one for the event
    loop and tokenizing, so decoding does not fight the HTTP side for cores; None (torch's own choice,
    which reads it) when OMP_NUM_THREADS is set."""
    import os

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus - 1)


def _check_port(host: str, port: int) -> None:
    """A port already taken is a one-line error before the model loads, not a traceback after."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror})") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
