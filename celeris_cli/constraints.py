"""A request's constraint as the ecosystem spells it, in one canonical form (no torch, no grammar engine).

Three spellings reach the one setting `structured_outputs` (`params.KNOBS`):

- OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or {"type":
  "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- vLLM's `structured_outputs`: exactly one of {"json": SCHEMA}, {"regex": "..."}, {"choice": [...]},
  {"grammar": "..."} (Lark, as llguidance takes it), {"json_object": true};
- the command line's `--structured-outputs JSON`, `--json-schema FILE`, `--regex`, `--choice` (cli).

The canonical value is compact JSON text of vLLM's form with one key, so that equal constraints are equal
settings (rows share a batch key) and a result's settings show what ran. A schema's key order is kept: the
answer's keys come in the order its properties are declared. A key this
module does not know, inside either object, is an error naming it: a constraint is never half honoured.
Sizes are bounded before anything is built from them (a schema of at most `MAX_SPEC_CHARS`).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import UsageError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # the canonical text of one constraint (measured: docs/structured.md)
MAX_SPEC_DEPTH = 64  # objects and lists inside each other (the grammar engine's own limit is about 128)
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1000
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def canonical(key: str, value: Any) -> str | None:
    """The canonical text of a constraint given under `key` (`response_format` or `structured_outputs`, as
    a mapping or its JSON text); None where it asks for none (`{"type": "text"}`). Errors name the key as
    the request wrote it (`response_format.json_schema.schema`)."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > MAX_SPEC_CHARS:
            raise UsageError(f"{key}: at most {MAX_SPEC_CHARS} characters, got {len(value)}")
        try:
            value = json.loads(value)
        except ValueError as e:
            raise UsageError(f"{key}: not JSON ({e})") from None
        except RecursionError:
            raise UsageError(f"{key}: nested more than {MAX_SPEC_DEPTH} levels deep") from None
    if _depth(value) > MAX_SPEC_DEPTH:
        raise UsageError(f"{key}: nested more than {MAX_SPEC_DEPTH} levels deep")
    if not isinstance(value, dict):
        raise UsageError(f"{key} must be an object, got {type(value).__name__}")
    openai = key.lstrip("-").replace("-", "_") == "response_format"  # a request's key or `--response-format`
    spec = _from_response_format(key, value) if openai else _from_structured(key, value)
    if spec is None:
        return None
    text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)  # key order kept: it is the answer's
    if len(text) > MAX_SPEC_CHARS:
        raise UsageError(f"{key}: at most {MAX_SPEC_CHARS} characters of constraint, got {len(text)}")
    return text


def _depth(value: Any) -> int:
    """How deeply objects and lists nest in a JSON value, counted without recursion (a hostile value may
    nest deeper than Python's stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d <= MAX_SPEC_DEPTH:
                todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse(text: str) -> tuple[str, Any]:
    """(kind, body) of a canonical text: the schema (a dict, or True for any object), the regex, the list of
    choices or the grammar."""
    spec = json.loads(text)
    ((kind, body),) = spec.items()
    return kind, body


def _from_response_format(key: str, value: dict[str, Any]) -> dict[str, Any] | None:
    _only(key, value, ("type", "json_schema"))
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise UsageError(f"{key}.type: unknown value {kind!r} (choose {', '.join(RESPONSE_FORMATS)})")
    if kind != "json_schema" and "json_schema" in value:
        raise UsageError(f"{key}.json_schema: only with type json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise UsageError(f"{key}.json_schema must be an object with a schema")
    _only(f"{key}.json_schema", inner, _JSON_SCHEMA_KEYS)
    if "strict" in inner and not isinstance(inner["strict"], bool) and inner["strict"] is not None:
        raise UsageError(f"{key}.json_schema.strict must be true or false")
    schema = inner.get("schema")
    if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
        return {"json_object": True}
    return {"json": _schema(f"{key}.json_schema.schema", schema)}


def _from_structured(key: str, value: dict[str, Any]) -> dict[str, Any]:
    _only(key, value, KINDS)
    given = [k for k in KINDS if k in value and value[k] is not None]
    if len(given) != 1:
        raise UsageError(
            f"{key}: give exactly one of {', '.join(KINDS)}" + (f" (got {', '.join(given)})" if given else "")
        )
    kind = given[0]
    body = value[kind]
    name = f"{key}.{kind}"
    if kind == "json":
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except ValueError as e:
                raise UsageError(f"{name}: not JSON ({e})") from None
        return {"json": _schema(name, body)}
    if kind == "json_object":
        if body is not True:
            raise UsageError(f"{name} must be true")
        return {"json_object": True}
    if kind in ("regex", "grammar"):
        if not isinstance(body, str) or not body:
            raise UsageError(f"{name} must be a non-empty string")
        return {kind: body}
    if not isinstance(body, list) or not body or len(body) > MAX_CHOICES:
        raise UsageError(f"{name} must be a list of 1 to {MAX_CHOICES} strings")
    if not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in body):
        raise UsageError(f"{name}: each choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters")
    return {"choice": list(body)}


def _schema(name: str, schema: Any) -> Any:
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise UsageError(f"{name} must be a JSON schema (an object), got {type(schema).__name__}")
    return schema


def _only(name: str, value: dict[str, Any], known: tuple[str, ...]) -> None:
    unknown = [k for k in value if k not in known]
    if unknown:
        raise UsageError(f"{name}.{unknown[0]}: not supported (Celeris takes {', '.join(known)})")
