"""`celeris generate`: prompts in, answers out."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer

from ..errors import CelerisError, UsageError
from ..params import MAX_SEED
from .app import CacheOpt, ConfidenceOpt, DeviceOpt, DtypeOpt, Remasking, StrategyOpt, app, fail

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
        from ..engine import load_engine

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
