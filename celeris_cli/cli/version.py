"""`celeris version`: what is installed and what `auto` resolves to on this machine, for bug reports."""

from __future__ import annotations

import platform

import typer

from .app import app


@app.command()
def version() -> None:
    """Print celeris's, Python's and torch's versions, and the device and dtype `auto` picks here."""
    import torch

    from .. import __version__
    from ..device import resolve_device, resolve_dtype

    device = resolve_device("auto")
    dtype = str(resolve_dtype("auto", device)).replace("torch.", "")
    typer.echo(f"celeris {__version__}")
    typer.echo(f"python {platform.python_version()}")
    typer.echo(f"torch {torch.__version__}")
    typer.echo(f"device {device} (auto)")
    typer.echo(f"dtype {dtype} (auto)")
