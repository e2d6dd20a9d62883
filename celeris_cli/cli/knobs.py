"""The generation settings as command-line options, made from their one declaration (`params.KNOBS`).

Each knob becomes `--name` (underscores as dashes, plus its alias and short flag) with the knob's help, its
choices and the embedded model's default (`defaults.knob_help`). Values arrive as typed and are checked by
`params` itself, so an error names the flag (`--top-p must be in (0, 1], got 1.5`) in the same words a
request or batch.yaml gets for its key. A knob declared in `KNOBS` appears here with nothing else to write.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import typer

from ..params import ALIASES, KNOBS, Knob, parse_text
from .defaults import knob_help

_METAVAR = {int: "N", float: "X", str: "TEXT", tuple: "TEXT"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _own_alias(alias: str) -> bool:
    """An alias whose values are spelled differently from its knob's (`--response-format` takes OpenAI's
    object, `--structured-outputs` vLLM's): an option of its own, so each value is read under its flag."""
    return KNOBS[ALIASES[alias]].convert is not None


def _option(name: str, knob: Knob, alias: str | None = None) -> inspect.Parameter:
    """The Typer parameter of one knob (or of an alias with its own spelling, `_own_alias`): text in (checked
    by `params`), a flag pair for a bool, repeatable for a list; no default of its own (an option left out
    is not a setting)."""
    text = knob_help(name, knob.help)
    if alias is not None:
        info = typer.Option(
            None,
            flag(alias),
            metavar=knob.metavar,
            help=f"The same setting as {flag(name)}, "
            'in OpenAI\'s spelling: {"type": "json_schema", "json_schema": {"name", "schema"}} '
            'or {"type": "json_object"}.',
            show_default=False,
        )
        return inspect.Parameter(alias, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=str)
    if knob.kind is bool:
        info, kind = typer.Option(None, f"{flag(name)}/--no-{flag(name)[2:]}", help=text), bool
    else:
        aliases = [flag(a) for a, n in ALIASES.items() if n == name and not _own_alias(a)]
        decls = [flag(name), *aliases, *([knob.short] if knob.short else [])]
        metavar = "<" + "|".join(knob.choices) + ">" if knob.choices else knob.metavar or _METAVAR[knob.kind]
        info = typer.Option(None, *decls, metavar=metavar, help=text, show_default=False)
        kind = list[str] if knob.kind is tuple and knob.text is None else str  # type: ignore[assignment]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)


def with_knob_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with every knob's option after its `model` option. The command receives the knobs given
    as `knobs`: {flag: value in the knob's type}; a value that is not of its type raises the UsageError
    naming the flag when the command reads it (`given`)."""
    sig = inspect.signature(command, eval_str=True)
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != "knobs"]
    at = next((i + 1 for i, p in enumerate(own) if p.name == "model"), len(own))
    spelled = [a for a in ALIASES if _own_alias(a)]
    knob_options = [_option(name, knob) for name, knob in KNOBS.items()]
    knob_options += [_option(ALIASES[a], KNOBS[ALIASES[a]], a) for a in spelled]
    params = own[:at] + knob_options + own[at:]

    @functools.wraps(command)
    def run(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name, None) for name in [*KNOBS, *spelled]}
        return command(knobs={flag(n): v for n, v in values.items() if v is not None and v != []}, **kwargs)

    run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def given(knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs from the command line, each in its knob's type (a UsageError naming the flag if not)."""
    return {key: parse_text(key, value) for key, value in knobs.items()}
