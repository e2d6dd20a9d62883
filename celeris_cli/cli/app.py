"""The Typer app every command registers on, the option choices they share, and the error exit.
The generation settings' options are made from `params.KNOBS` (`knobs.py`).

Torch is imported lazily inside the commands, so `celeris --help` answers at once. User errors
(CelerisError) become one `Error: ...` line on stderr and an exit code; nothing else is caught here.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Any, NoReturn

import typer
import typer.core

from ..errors import CelerisError, UsageError


class _Command(typer.core.TyperCommand):
    """Typer writes a required argument as `{LOG}` on the usage line, which reads as a template to fill
    in; Click's plain `LOG` (an optional one stays `[CONFIG]`)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.+)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


class _App(typer.Typer):
    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # Click's plain help: no Rich import, and paragraphs rewrapped to the terminal
    # Typer coerces every option value that is not already a bool through pydantic, whose import alone
    # costs ~70 ms; the root's flags default to None, so `celeris CMD --help` would pay it. As bools they
    # skip it, and help stays instant.
    context_settings={"default_map": {"help": False, "install_completion": False, "show_completion": False}},
    help="Batch generation with masked diffusion language models.",
)


class DeviceOpt(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DtypeOpt(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class QuantizeOpt(str, Enum):
    none = "none"
    int8 = "int8"
    int4 = "int4"


def choice(default: Enum, *decls: str, **options: Any) -> Any:
    """An option of one of an Enum's values. Typer checks a choice through pydantic, whose message leaks
    into the error ("Value error, 'int3' is not one of ..."); this parser raises Click's own BadParameter,
    shown as "Invalid value for '--quantize': 'int3' is not one of 'none', 'int8', 'int4'"."""
    kind = type(default)

    def parse(value: Any) -> Any:
        if isinstance(value, kind):
            return value
        try:
            return kind(value)
        except ValueError:
            names = ", ".join(repr(member.value) for member in kind)
            raise typer.BadParameter(f"{value!r} is not one of {names}") from None

    metavar = "<" + "|".join(str(member.value) for member in kind) + ">"
    return typer.Option(default, *decls, parser=parse, metavar=metavar, **options)


QUANTIZE_HELP = (
    "Weights, quantized as they load: int8 (every linear layer and the embedding, per channel) or int4"
    " (linear layers in groups of up to 128; the embedding int8)."
)
MAX_MEMORY_HELP = (
    "Memory the batches may use, as 8GiB or 512MB: each batch is the largest the planner expects to fit "
    "(default: none on the CPU, 90% of the card's free memory and the weights on CUDA)."
)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"celeris {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Batch generation with masked diffusion language models."""


def fail(err: CelerisError) -> NoReturn:
    typer.echo(f"Error: {err}", err=True)
    raise typer.Exit(err.exit_code)


def _json_setting(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--set must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise UsageError("--set must be a JSON object")
    return value
