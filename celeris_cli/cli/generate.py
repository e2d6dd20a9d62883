"""`celeris generate`: prompts in, answers out, in input order, each batch written as it finishes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, CelerisError, UsageError
from .answering import prepare, run
from .app import AlgOpt, CacheOpt, ConfidenceOpt, DeviceOpt, DtypeOpt, Remasking, StrategyOpt, app, fail
from .defaults import knob_help
from .output import Format, Sink
from .prompts import gather

STEPS_HELP = (
    "Denoising steps in total. They are spread over the blocks (gen-length / block-length of them): "
    "equal shares, the remainder to the first blocks, and at least one step per block. More steps "
    "commit fewer tokens per step: better quality, proportionally more time."
)


@app.command()
def generate(
    args: list[str] = typer.Argument(None, metavar="PROMPT", show_default=False, hidden=True),
    prompt: list[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT", help="A prompt; repeat for several."),
    file: Path = typer.Option(
        None,
        "--file",
        "-f",
        metavar="FILE",
        help="A text file with one prompt per line; - reads stdin (as does a pipe when no prompt is given). "
        "A bad or too long line is reported with its line number and skipped, and the run exits 1.",
    ),
    model: Path = typer.Option(
        None, "--model", "-m", metavar="FOLDER", help="Model folder (default: the embedded model)."
    ),
    denoise_steps: int = typer.Option(
        None, "--denoise-steps", "--steps", min=1, metavar="N", help=knob_help("denoise_steps", STEPS_HELP)
    ),
    gen_length: int = typer.Option(
        None, "--gen-length", min=1, metavar="N", help=knob_help("gen_length", "Tokens to generate (the canvas).")
    ),
    block_length: int = typer.Option(
        None,
        "--block-length",
        min=1,
        metavar="N",
        help=knob_help("block_length", "Semi-autoregressive block size, decoded left to right."),
    ),
    temperature: float = typer.Option(
        None,
        "--temperature",
        "-t",
        min=0.0,
        metavar="X",
        help=knob_help("temperature", "0 is greedy; > 0 samples with float64 Gumbel noise."),
    ),
    min_p: float = typer.Option(
        None,
        "--min-p",
        metavar="X",
        help=knob_help("min_p", "When sampling, drop tokens less likely than min-p times the top one (0 = off)."),
    ),
    remasking: Remasking = typer.Option(
        None, "--remasking", help=knob_help("remasking", "Which predictions to commit first.")
    ),
    order_temperature: float = typer.Option(
        None,
        "--order-temperature",
        metavar="X",
        help=knob_help(
            "order_temperature",
            "Gumbel noise on which positions commit first, fading over each block (MaskGIT; 0 = off).",
        ),
    ),
    top_p: float = typer.Option(
        None,
        "--top-p",
        metavar="X",
        help=knob_help("top_p", "When sampling, keep the likeliest tokens holding this mass."),
    ),
    top_k: int = typer.Option(
        None, "--top-k", metavar="K", help=knob_help("top_k", "When sampling, keep the k likeliest tokens (0 = off).")
    ),
    stop: list[str] = typer.Option(
        None, "--stop", metavar="TEXT", help="Cut the answer before this string; repeat for several."
    ),
    cfg_scale: float = typer.Option(
        None, "--cfg-scale", min=0.0, metavar="X", help=knob_help("cfg_scale", "Classifier-free guidance (0 = off).")
    ),
    seed: int = typer.Option(
        None,
        "--seed",
        metavar="N",
        help=knob_help(
            "seed", "Random seed (0..2^63-1). Each prompt's answer depends on it alone, not on batch mates."
        ),
    ),
    samples: int = typer.Option(
        1, "--samples", min=1, metavar="N", help="Answers per prompt, with seeds seed, seed+1, ..."
    ),
    strategy: StrategyOpt = typer.Option(
        None,
        "--strategy",
        help=knob_help(
            "strategy",
            "fast (cache, threshold, early exit), reference (LLaDA's decoder), dream (Dream's own), block or "
            "block-fast (block diffusion, LLaDA2; block-fast keeps an exact cache). The model folder's "
            "architecture says which run on it (celeris inspect).",
        ),
    ),
    threshold: float = typer.Option(
        None,
        "--threshold",
        min=0.0,
        max=1.0,
        metavar="X",
        help=knob_help("threshold", "fast: also commit every position at least this confident."),
    ),
    cache: CacheOpt = typer.Option(
        None, "--cache", help=knob_help("cache", "fast: KV cache refreshed once per block.")
    ),
    confidence: ConfidenceOpt = typer.Option(
        None, "--confidence", help=knob_help("confidence", "fast: how confidence is measured.")
    ),
    early_exit: bool = typer.Option(
        None,
        "--early-exit/--no-early-exit",
        help=knob_help("early_exit", "fast: stop a row once its end-of-text is decoded."),
    ),
    suffix_window: int = typer.Option(
        None,
        "--suffix-window",
        min=0,
        metavar="N",
        help=knob_help(
            "suffix_window",
            "fast: the model sees at most N masked positions past the active block (0 = the whole canvas).",
        ),
    ),
    presence_penalty: float = typer.Option(
        None,
        "--presence-penalty",
        min=0.0,
        metavar="X",
        help=knob_help(
            "presence_penalty", "fast, block: subtract X from the logit of every token already in the answer."
        ),
    ),
    min_tokens: int = typer.Option(
        None,
        "--min-tokens",
        min=0,
        metavar="N",
        help=knob_help("min_tokens", "fast, block: no end of text among the answer's first N tokens."),
    ),
    subword_min_p: float = typer.Option(
        None,
        "--subword-min-p",
        min=0.0,
        max=1.0,
        metavar="X",
        help=knob_help(
            "subword_min_p",
            "fast, block: when sampling, drop a piece that continues a word when less likely than X times the "
            "likeliest token.",
        ),
    ),
    alg: AlgOpt = typer.Option(None, "--alg", help=knob_help("alg", "dream: which positions unmask first.")),
    alg_temp: float = typer.Option(
        None,
        "--alg-temp",
        min=0.0,
        metavar="X",
        help=knob_help("alg_temp", "dream: draw positions from softmax(confidence / X) instead (0 = in order)."),
    ),
    eps: float = typer.Option(
        None, "--eps", metavar="X", help=knob_help("eps", "dream: the time schedule's end, in (0, 1).")
    ),
    block_steps: int = typer.Option(
        None, "--block-steps", min=1, metavar="N", help=knob_help("block_steps", "block: denoising steps per block.")
    ),
    batch_size: int = typer.Option(16, "--batch-size", min=1, metavar="N", help="Prompts decoded together."),
    device: DeviceOpt = typer.Option(DeviceOpt.auto, "--device", help="auto picks CUDA when present."),
    dtype: DtypeOpt = typer.Option(DtypeOpt.auto, "--dtype", help="auto picks bfloat16 where it is fast."),
    chat: bool = typer.Option(False, "--chat", help="Render prompts with the model's chat template."),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON document (an array for several prompts), at the end.",
    ),
    as_jsonl: bool = typer.Option(False, "--jsonl", help="Print one JSON record per line, each batch as it finishes."),
    output: Path = typer.Option(
        None, "--output", "-o", metavar="FILE", help="Write answers to this file (atomically), not stdout."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no summary line on stderr."),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Any bad --file line fails the whole run (exit 2) before it starts.",
    ),
) -> None:
    """Answer prompts given as arguments, with --prompt, in a --file, or piped on stdin.

    Answers are written in input order, each batch as soon as it finishes (--json: at the end).
    Ctrl-C writes what is finished and exits 130. The defaults shown are the embedded model's; another
    --model brings its own generation_config.json."""
    try:
        if as_json and as_jsonl:
            raise UsageError("choose one of --json and --jsonl")
        prompts, bad = gather(list(args or []), list(prompt or []), file)
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
                suffix_window=suffix_window,
                presence_penalty=presence_penalty,
                min_tokens=min_tokens,
                subword_min_p=subword_min_p,
                alg=alg.value if alg else None,
                alg_temp=alg_temp,
                eps=eps,
                block_steps=block_steps,
            ).items()
            if v is not None
        }
        from ..engine import load_engine

        engine = load_engine(model, device.value, dtype.value)
        params = engine.params(overrides)
        jobs, skipped = prepare(engine, params, prompts, bad, chat, strict, samples)
        fmt: Format = "json" if as_json else "jsonl" if as_jsonl else "text"
        sink = Sink(fmt, output, single=len(jobs) == 1 and not skipped)
    except CelerisError as e:
        fail(e)
    except KeyboardInterrupt:
        typer.echo("Interrupted before any answer", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    run(engine, params, jobs, batch_size, sink, quiet)
    if skipped:
        typer.echo(f"Error: {skipped} line(s) skipped (see above)", err=True)
    raise typer.Exit(EXIT_FAILED if skipped else EXIT_OK)
