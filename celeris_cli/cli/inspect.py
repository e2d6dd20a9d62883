"""`celeris inspect MODEL`: what a model folder holds, read from its files without loading the weights."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import CelerisError
from .app import app, fail


@app.command()
def inspect(
    model: Path = typer.Argument(None, metavar="FOLDER", help="Model folder (default: the embedded model)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Print a model folder's architecture, layout, attention, parameters (active ones for a mixture of
    experts), weight dtypes and bf16 size, special ids, chat template, logit shift, block and the decoding
    strategies it supports, from config.json, the safetensors headers and the tokenizer."""
    try:
        from ..arch.describe import describe
        from ..engine import model_dir

        info = describe(model_dir(model))
    except CelerisError as e:
        fail(e)
    if as_json:
        typer.echo(json.dumps(info, indent=2, ensure_ascii=False))
        return
    for key, value in info.items():
        shown = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) else value
        typer.echo(f"{key:<18} {shown}")
