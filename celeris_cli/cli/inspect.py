"""`celeris inspect MODEL`: what a model folder holds, read from its files without loading the weights;
with --memory, the memory a decode is expected to need (`arch.memory`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ..errors import CelerisError
from .app import MAX_MEMORY_HELP, DtypeOpt, QuantizeOpt, app, choice, fail

PARTS = ("weights", "kv_cache", "activations", "logits", "peak")


@app.command()
def inspect(
    model: Path = typer.Argument(None, metavar="FOLDER", help="Model folder (default: the embedded model)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    memory: bool = typer.Option(
        False, "--memory", help="Print the expected peak memory of a decode, split (an estimate; no weight is read)."
    ),
    batch_size: int = typer.Option(1, "--batch-size", min=1, metavar="N", help="--memory: rows decoded together."),
    gen_length: int = typer.Option(None, "--gen-length", min=1, metavar="N", help="--memory: default the model's."),
    prompt_length: int = typer.Option(64, "--prompt-length", min=1, metavar="N", help="--memory: prompt tokens."),
    dtype: DtypeOpt = choice(DtypeOpt.auto, "--dtype", help="--memory: auto is what this machine would pick."),
    quantize: QuantizeOpt = choice(QuantizeOpt.none, "--quantize", help="--memory: the weights' format."),
    max_memory: str = typer.Option(None, "--max-memory", metavar="SIZE", help=MAX_MEMORY_HELP),
) -> None:
    """Print a model folder's architecture, layout, attention, parameters (active ones for a mixture of
    experts), weight dtypes and bf16 size, special ids, chat template, logit shift, block and the decoding
    strategies it supports, from config.json, the safetensors headers and the tokenizer."""
    try:
        from ..engine import model_dir

        folder = model_dir(model)
        if memory:
            _memory(folder, batch_size, gen_length, prompt_length, dtype.value, quantize.value, max_memory, as_json)
            return
        from ..arch.describe import describe

        info = describe(folder)
    except CelerisError as e:
        fail(e)
    if as_json:
        typer.echo(json.dumps(info, indent=2, ensure_ascii=False))
        return
    for key, value in info.items():
        shown = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) else value
        typer.echo(f"{key:<18} {shown}")


def _memory(
    folder: Path,
    batch: int,
    gen_length: int | None,
    prompt: int,
    dtype: str,
    quantize: str,
    max_memory: str | None,
    as_json: bool,
) -> None:
    from ..arch.budget import folder_report
    from ..arch.memory_sizes import human
    from ..device import resolve_device, resolve_dtype

    if dtype == "auto":
        dtype = str(resolve_dtype("auto", resolve_device("auto"))).replace("torch.", "")
    overrides: dict[str, Any] = {"gen_length": gen_length} if gen_length else {}
    from ..arch.folder import ModelFolder

    r = folder_report(folder, batch, prompt, dtype, quantize, max_memory, overrides)
    r["ignored"] = ModelFolder.open(folder).ignored_keys
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    typer.echo(
        f"expected peak (an estimate) for {r['strategy']}, batch {batch}, {prompt} prompt + {r['gen_length']} "
        f"generated tokens, {dtype}, " + ("weights not quantized:" if quantize == "none" else f"{quantize} weights:")
    )
    for part in PARTS:
        typer.echo(f"  {part.replace('_', ' '):<12} {human(r[part]):>10}")
    if "largest_batch" in r:
        fits = r["largest_batch"]
        said = f"{fits}" if fits else "none (not even one row fits)"
        typer.echo(f"  largest batch within {human(r['max_memory'])}: {said}")
    typer.echo(f"config.json keys ignored: {', '.join(r['ignored']) or 'none'}")
