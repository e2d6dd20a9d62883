"""The command line's short forms of a constraint: `--json-schema FILE`, `--regex TEXT`, `--choice TEXT`
(repeatable), each the one setting `structured_outputs` in vLLM's spelling (`constraints`). One form per
run: two of them, or one beside `--structured-outputs` / `--response-format`, is an error naming both."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer

from ..constraints import MAX_SPEC_CHARS
from ..errors import UsageError

JSON_SCHEMA_HELP = "Hold the answer to the JSON schema in FILE (the --structured-outputs '{\"json\": ...}' setting)."
REGEX_HELP = "Hold the answer to a regular expression (the --structured-outputs '{\"regex\": ...}' setting)."
CHOICE_HELP = (
    "The answer is one of these texts; repeat for each (the --structured-outputs '{\"choice\": [...]}' setting)."
)
SPELLINGS = ("--structured-outputs", "--response-format")


def json_schema_option() -> Any:
    return typer.Option(None, "--json-schema", metavar="FILE", help=JSON_SCHEMA_HELP, show_default=False)


def regex_option() -> Any:
    return typer.Option(None, "--regex", metavar="TEXT", help=REGEX_HELP, show_default=False)


def choice_option() -> Any:
    return typer.Option(None, "--choice", metavar="TEXT", help=CHOICE_HELP, show_default=False)


def with_constraint(
    knobs: dict[str, Any], json_schema: Path | None, regex: str | None, choices: list[str] | None
) -> dict[str, Any]:
    """`knobs` (the settings' options by flag) with the short form given, if any, as `--structured-outputs`."""
    forms = {
        "--json-schema": json_schema,
        "--regex": regex,
        "--choice": choices or None,
    }
    given = [f for f, v in forms.items() if v is not None]
    given += [f for f in SPELLINGS if f in knobs]
    if len(given) > 1:
        raise UsageError(f"{given[0]} and {given[1]}: give one constraint")
    if json_schema is not None:
        spec: dict[str, Any] = {"json": _schema_file(json_schema)}
    elif regex is not None:
        spec = {"regex": regex}
    elif choices:
        spec = {"choice": list(choices)}
    else:
        return knobs
    return {**knobs, "--structured-outputs": json.dumps(spec, ensure_ascii=False)}


def _schema_file(path: Path) -> Any:
    """A JSON schema read from a file, its size bounded before it is read."""
    try:
        if os.path.getsize(path) > MAX_SPEC_CHARS * 4:
            raise UsageError(f"--json-schema: {path} is larger than {MAX_SPEC_CHARS * 4} bytes")
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--json-schema: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--json-schema: {path} is not UTF-8 text") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise UsageError(f"--json-schema: {path} is not JSON ({e})") from None
    except RecursionError:
        raise UsageError(f"--json-schema: {path} is nested too deeply") from None
