"""The `celeris` command line: parses options, calls the library, renders results.

One module per command group registers its commands on the shared Typer `app`, in the order `--help`
lists them. Torch is imported lazily inside the commands, so `celeris --help` answers at once.
"""

from __future__ import annotations

import sys
from importlib import import_module

from .app import app

# Importing a command module registers its commands; --help lists them in this order, command groups
# (`bench` and its subcommands) after the plain commands.
_MODULES = ("generate", "batch", "queue", "serve", "recipe", "measure", "bench", "bench_only", "inspect", "version")
for _module in _MODULES:
    import_module(f"{__name__}.{_module}")

__all__ = ["app", "main"]


def main() -> None:
    from .batch import _optional_ray_address

    app(args=_optional_ray_address(sys.argv[1:]))
