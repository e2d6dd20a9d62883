"""The `celeris` command line: parses options, calls the library, renders results.

One module per command group registers its commands on the shared Typer `app`; the root group imports a
command's module only when that command runs or shows its help (`app.COMMANDS`, in the order `--help` lists
them), and torch is imported lazily inside the commands, so `celeris --help` answers at once.
"""

from __future__ import annotations

import sys

from .app import app, load_commands

__all__ = ["app", "load_commands", "main"]


def main() -> None:
    from .batch import _optional_ray_address

    app(args=_optional_ray_address(sys.argv[1:]))
