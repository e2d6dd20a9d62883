"""Template-pinned decoding: where a JSON schema has a fixed shape, its fixed tokens are laid into the canvas
up front and only the values are denoised, all of them in parallel.

A schema has a fixed shape (`shape`) when every part of the answer but its leaf values is known: objects
whose properties are all required with no others allowed, arrays of exactly n items, and leaves whose
longest valid text is bounded: `enum`/`const`, booleans, null, integers with a minimum and a maximum, and
strings with a `maxLength` (and no pattern or format). Anything else (optional keys, arrays of unknown
length, unbounded numbers, patterns) has no fixed shape and is refused by name; the left-to-right rule (the
default `structured_layout`) serves every constraint.

The answer is laid out as compact JSON in the schema's property order: fixed text (`{"name":`), a value slot,
fixed text (`,"age":`), ... then the end of text. A slot has as many positions as its longest valid value
has bytes (a token is at least one byte, so the value always fits: a string of maxLength n takes at most
n + 2 tokens unless a character needs several tokens or an escape, which the last position's check below
refuses), and its own grammar: the value, then blanks (`VALUE " "*`, JSON allows blanks after a value), so
a short value is followed by spaces up to the slot's end. Every slot is decoded by the left-to-right rule of
`structured.commit` at once: its leftmost open position under its own grammar's mask, the step's picks after
it while its grammar accepts them. At a slot's last position only a token that completes its value is
taken. The fixed tokens are the tokenizer's greedy tokenization of the fixed text; they count as output
tokens, with log probability 0 (the grammar leaves no other choice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..constraints import parse
from ..errors import UsageError
from .grammar import Grammar, Vocabulary, check

_SCALARS = {"boolean": 5, "null": 4}


class TooLong(Exception):
    """A fixed shape whose answer takes more positions than the limit (`shape`)."""


def _least(parts: list[str | dict[str, Any]]) -> int:
    """The fewest positions parts take: a slot's budget, a token at least per fixed text."""
    return sum(1 if isinstance(p, str) else (_leaf_budget(p) or 1) for p in parts)


def shape(schema: Any, limit: int) -> list[str | dict[str, Any]] | None:
    """The answer as fixed texts and leaf schemas (value slots) in order, or None without a fixed shape.
    Raises TooLong before it lays out more than `limit` positions (an array of 1000 arrays of 1000 is
    refused by arithmetic, never expanded)."""
    if not isinstance(schema, dict):
        return None
    if _leaf_budget(schema) is not None:
        return [schema]
    kind = schema.get("type")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        extra = set(schema) - {"type", "properties", "required", "additionalProperties", "title", "description"}
        if not isinstance(props, dict) or not props or extra or schema.get("additionalProperties") is not False:
            return None
        if sorted(schema.get("required") or []) != sorted(props):
            return None
        out: list[str | dict[str, Any]] = []
        for i, (key, sub) in enumerate(props.items()):
            inner = shape(sub, limit)
            if inner is None:
                return None
            out += [("{" if i == 0 else ",") + json.dumps(key, ensure_ascii=False) + ":", *inner]
            if _least(out) > limit:
                raise TooLong
        return _merged([*out, "}"])
    if kind == "array":
        n, items = schema.get("minItems"), schema.get("items")
        extra = set(schema) - {"type", "items", "minItems", "maxItems", "title", "description"}
        if extra or not isinstance(n, int) or n < 1 or schema.get("maxItems") != n:
            return None
        inner = shape(items, limit)
        if inner is None:
            return None
        if n * (_least(inner) + 1) > limit:
            raise TooLong
        out = []
        for i in range(n):
            out += ["[" if i == 0 else ",", *inner]
        return _merged([*out, "]"])
    return None


def _leaf_budget(schema: dict[str, Any]) -> int | None:
    """The most bytes a leaf value's JSON text can take, or None if it is not a bounded leaf."""
    keys = set(schema) - {"title", "description"}
    if "enum" in schema and keys <= {"enum", "type"} and isinstance(schema["enum"], list) and schema["enum"]:
        return max(len(json.dumps(v, ensure_ascii=False).encode()) for v in schema["enum"])
    if "const" in schema and keys <= {"const", "type"}:
        return len(json.dumps(schema["const"], ensure_ascii=False).encode())
    kind = schema.get("type")
    if kind in _SCALARS and keys == {"type"}:
        return _SCALARS[kind]
    if kind == "integer" and keys <= {"type", "minimum", "maximum"}:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if isinstance(lo, int) and isinstance(hi, int) and lo <= hi:
            return max(len(str(lo)), len(str(hi)))
    if kind == "string" and keys <= {"type", "maxLength", "minLength"}:
        n = schema.get("maxLength")
        if isinstance(n, int) and 0 <= n <= 256:
            return n + 2
    return None


def _merged(parts: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
    out: list[str | dict[str, Any]] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] = out[-1] + p
        else:
            out.append(p)
    return out


@dataclass
class Slot:
    """One value's positions [start, end) of the answer and its grammar."""

    start: int
    end: int
    grammar: Grammar


@dataclass
class Template:
    """A fixed-shape answer: its fixed tokens by answer position, its slots, and its length (the end of text
    included)."""

    fixed: dict[int, int]
    slots: list[Slot]
    length: int


def build(spec_text: str, vocab: Vocabulary, limit: int) -> Template | None:
    """The template of a JSON schema constraint with a fixed shape; None otherwise. Raises TooLong for one
    that takes more than `limit` positions."""
    kind, body = parse(spec_text)
    parts = shape(body, limit) if kind == "json" else None
    if parts is None:
        return None
    fixed: dict[int, int] = {}
    slots: list[Slot] = []
    at = 0
    for part in parts:
        if isinstance(part, str):
            tokens = vocab.tokens_of(part)
            if b"".join(vocab.tokens[t] for t in tokens) != part.encode():
                raise UsageError(f"structured_layout template: this model's vocabulary cannot spell {part!r}")
            for t in tokens:
                fixed[at] = t
                at += 1
        else:
            budget = _leaf_budget(part)
            assert budget is not None
            lark = f'start: %json {json.dumps(part)} BLANK*\nBLANK: " "\n'
            slots.append(Slot(at, at + budget, Grammar(spec_text, vocab, slot=lark)))
            at += budget
    fixed[at] = vocab.eos_id
    return Template(fixed, slots, at + 1)


def template_for(spec_text: str | None, layout: str, vocab: Vocabulary, gen_length: int) -> Template | None:
    """The template a request decodes with under `structured_layout` template: its schema's (an error naming
    the setting if it has no fixed shape or does not fit the answer's length); None under left-to-right."""
    if spec_text is None or layout != "template":
        return None
    try:
        template = build(spec_text, vocab, gen_length)
    except TooLong:
        raise UsageError(
            "structured_layout template: the schema's template takes more tokens than gen_length (max_tokens) "
            f"{gen_length}"
        ) from None
    if template is None:
        raise UsageError(
            "structured_layout template: the constraint is not a JSON schema of a fixed shape (every "
            "property required, no other properties, arrays of a fixed length, bounded leaves: enums, "
            "integers with a minimum and a maximum, strings with a maxLength); use left-to-right"
        )
    if template.length > gen_length:
        raise UsageError(
            f"structured_layout template: the schema's template takes {template.length} tokens, more than "
            f"gen_length (max_tokens) {gen_length}"
        )
    return template


def check_structure(params: Any, vocab: Vocabulary) -> None:
    """A request's constraint (GenerationParams' `structured_outputs`, `structured_layout`, `gen_length`)
    checked against a model's vocabulary before anything decodes: the grammar builds and can begin
    (`grammar.check`), and a template, where one is asked for, fits (`template_for`). The engine and the
    queue's Preparer (which has no weights) both call this."""
    if params.structured_outputs is not None:
        check(params.structured_outputs, vocab)
        template_for(params.structured_outputs, params.structured_layout, vocab, params.gen_length)
