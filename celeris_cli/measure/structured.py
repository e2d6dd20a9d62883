"""An extraction workload decoded three ways side by side (`celeris bench structured`): unconstrained, held
left to right to its JSON schema (`structured_layout: left-to-right`), and template-pinned (`structured_layout:
template`) where the schema has a fixed shape and the model's strategy leaves slots open (a strategy that decides
left to right, as `spec`, decodes the template row left to right, and pins nothing).

The workload is short extraction prompts over six schemas ("Extract the person: Ada Lovelace, 36 years old.":
a person, a product, an event with an enum and a date pattern, a nested address, an array of tags, a label),
built deterministically from small lists, request i with seed i in every way. Four of the schemas have a fixed
shape (`structured.template.shape`); the event (a pattern) and the tags (an array of unknown length) do not,
and in the template row they decode left to right, as does a fixed shape whose template is longer than the
answer: every way decodes the same requests, and the row counts how many were pinned. Each way goes through
the engine's running set (`Engine.decode_running`), its rows' settings each its own request's, as a server or
a queue would run them.

An answer parses when its whole text is JSON, and validates when `jsonschema` accepts it against the schema as
given (the grammar engine closes objects to other keys: a subset of what the schema allows).
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..engine import Engine, Result
from ..errors import UsageError
from ..strategy import STRATEGIES
from ..structured.template import TooLong, build
from .bench import hardware

MAX_REQUESTS = 10_000
MAX_GEN_LENGTH = 1024
WAYS = ("unconstrained", "left-to-right", "template")

_TEXT: dict[str, Any] = {"type": "string", "minLength": 1}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {**_TEXT, "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "title": {**_TEXT, "maxLength": 24},
            "price": {"type": "integer", "minimum": 0, "maximum": 10000},
            "in_stock": {"type": "boolean"},
        },
        "required": ["title", "price", "in_stock"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "name": {**_TEXT, "maxLength": 24},
            "kind": {"enum": ["concert", "festival", "lecture", "match"]},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        },
        "required": ["name", "kind", "date"],
        "additionalProperties": False,
    },
    "address": {
        "type": "object",
        "properties": {
            "name": {**_TEXT, "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {
                    "street": {**_TEXT, "maxLength": 20},
                    "city": {**_TEXT, "maxLength": 12},
                },
                "required": ["street", "city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {**_TEXT, "maxLength": 12}, "maxItems": 4}},
        "required": ["tags"],
    },
    "label": {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["label"],
        "additionalProperties": False,
    },
}

_PEOPLE = [("Ada Lovelace", 36), ("Alan Turing", 41), ("Grace Hopper", 85), ("Emmy Noether", 53), ("Kurt Godel", 71)]
_PRODUCTS = [("Blue kettle", 24, "in stock"), ("Oak desk", 310, "sold out"), ("Wool scarf", 18, "in stock"),
             ("Desk lamp", 42, "sold out")]  # fmt: skip
_EVENTS = [("Harvest fair", "festival", "2026-09-14"), ("Night quartet", "concert", "2026-11-02"),
           ("Cup final", "match", "2027-05-22"), ("On comets", "lecture", "2026-12-08")]  # fmt: skip
_ADDRESSES = [("Ada", "12 Mill Lane", "Leeds"), ("Bob", "4 Rue Cler", "Paris"), ("Chen", "88 Nanjing Road", "Shanghai")]
_TAGGED = ["a red wooden toy train for children", "fresh bread, butter and jam", "a quiet hotel by the sea",
           "an old map of the northern hills"]  # fmt: skip
_LABELLED = ["I loved the soup.", "The train was late again.", "The meeting is at noon.", "What a wonderful day!",
             "The lid broke after a week."]  # fmt: skip


def _prompt(schema: str, k: int) -> str:
    """The k-th extraction prompt for `schema`, cycling through its small list."""
    if schema == "person":
        name, age = _PEOPLE[k % len(_PEOPLE)]
        return f"Extract the person: {name}, {age} years old."
    if schema == "product":
        title, price, stock = _PRODUCTS[k % len(_PRODUCTS)]
        return f"Extract the product: {title}, {price} dollars, {stock}."
    if schema == "event":
        name, kind, date = _EVENTS[k % len(_EVENTS)]
        return f"Extract the event: {name}, a {kind} on {date}."
    if schema == "address":
        name, street, city = _ADDRESSES[k % len(_ADDRESSES)]
        return f"Extract the address: {name} lives at {street}, {city}."
    if schema == "tags":
        return f"Extract up to four tags: {_TAGGED[k % len(_TAGGED)]}."
    return f"Label the sentiment: {_LABELLED[k % len(_LABELLED)]}"


def workload(n: int) -> list[tuple[str, str]]:
    """(schema name, prompt) for n requests, the schemas in turn."""
    names = list(SCHEMAS)
    return [(names[i % len(names)], _prompt(names[i % len(names)], i // len(names))) for i in range(n)]


def bench_structured(
    engine: Engine,
    n_requests: int = 200,
    gen_length: int = 96,
    batch_size: int = 16,
    setting: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decode the workload unconstrained, left to right and template-pinned, one running set each, in that
    order after a warm-up; per way the counts of answers that parse, validate and finish each way, output
    tokens/s, forwards per answer and wall time, and per schema the same counts. setting: settings under the
    workload's own (`--set`: a strategy with structured output, where the model's default has none)."""
    import jsonschema

    if not 1 <= n_requests <= MAX_REQUESTS:
        raise UsageError(f"--requests must be 1 to {MAX_REQUESTS}, got {n_requests}")
    if not 1 <= gen_length <= MAX_GEN_LENGTH:
        raise UsageError(f"--gen-length must be 1 to {MAX_GEN_LENGTH}, got {gen_length}")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, got {batch_size}")
    requests = workload(n_requests)
    prompts = [p for _, p in requests]
    encoded = [engine.encode_prompt(p) for p in prompts]
    base = dict(setting or {})
    plain = engine.params({**base, "gen_length": gen_length})
    for ids in encoded:
        engine.check_fits(len(ids), plain)
    if "structure" not in STRATEGIES[plain.strategy].parts:
        raise UsageError(
            f"the {plain.strategy} strategy has no structured output; give a strategy that has with "
            """--set '{"strategy": ...}' (`celeris inspect` lists the model's)"""
        )
    vocab = engine.vocabulary()
    # a strategy that decides left to right holds no template open: its template row decodes left to right
    templates = not STRATEGIES[plain.strategy].left_to_right
    pinned = {name: templates and _pins(schema, vocab, gen_length) for name, schema in SCHEMAS.items()}

    def settings(way: str, i: int) -> Any:
        name, prompt = requests[i]
        layer: dict[str, Any] = {**base, "gen_length": gen_length, "seed": i}
        if way != "unconstrained":
            layout = "template" if way == "template" and pinned[name] else "left-to-right"
            layer |= {"structured_outputs": json.dumps({"json": SCHEMAS[name]}), "structured_layout": layout}
        params = engine.params_for(prompt, engine.params(layer))
        if not engine.continuous(params):
            raise UsageError(
                f"the running set does not decode this model's {params.strategy} rows; give a strategy it does with "
                """--set '{"strategy": ...}' (`celeris inspect` lists the model's)"""
            )
        return params

    seeds = list(range(n_requests))
    warm = [settings("unconstrained", i) for i in range(min(2, n_requests))]
    engine.decode_running(prompts[:2], encoded[:2], warm, seeds[:2], 2)  # the first forwards, charged to none
    rows = []
    for way in WAYS:
        params = [settings(way, i) for i in range(n_requests)]
        t0 = time.perf_counter()
        results = engine.decode_running(prompts, encoded, params, seeds, batch_size)
        wall = time.perf_counter() - t0
        row = {"way": way, **_score(results, [n for n, _ in requests], jsonschema), "wall_s": round(wall, 2)}
        row["tokens_per_s"] = round(row["output_tokens"] / wall, 2) if wall > 0 else 0.0
        row["pinned"] = sum(p.structured_layout == "template" for p in params) if way == "template" else 0
        rows.append(row)
    return {
        "hardware": hardware(),
        "model": engine.model_dir.name if engine.model_dir else "?",
        "strategy": plain.strategy,
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "requests": n_requests,
        "gen_length": gen_length,
        "batch_size": batch_size,
        "schemas": {name: {"pinned": pinned[name], "schema": SCHEMAS[name]} for name in SCHEMAS},
        "rows": rows,
    }


def _pins(schema: dict[str, Any], vocab: Any, gen_length: int) -> bool:
    """Whether the template row pins this schema: it has a fixed shape and its template fits the answer."""
    try:
        template = build(json.dumps({"json": schema}), vocab, gen_length)
    except TooLong:
        return False
    return template is not None and template.length <= gen_length


def _score(results: list[Result], names: list[str], jsonschema: Any) -> dict[str, Any]:
    """The counts of one way's answers: parsing as JSON, valid against their schema (in all and among those
    that finished with "stop"), finish reasons, constraint errors; output tokens and mean forwards per answer;
    and the counts per schema."""
    out: dict[str, Any] = {"answers": len(results), "parses": 0, "validates": 0, "stop": 0, "length": 0,
                           "stop_validates": 0, "errors": 0, "output_tokens": 0, "by_schema": {}}  # fmt: skip
    for name, r in zip(names, results):
        ok = _valid(r.text, SCHEMAS[name], jsonschema)
        each = out["by_schema"].setdefault(name, {"answers": 0, "parses": 0, "validates": 0, "stop": 0})
        each["answers"] += 1
        for counts in (out, each):
            counts["parses"] += ok is not None
            counts["validates"] += bool(ok)
            counts["stop"] += r.finish_reason == "stop"
        out["length"] += r.finish_reason == "length"
        out["stop_validates"] += bool(ok) and r.finish_reason == "stop"
        out["errors"] += r.error is not None
        out["output_tokens"] += r.output_tokens
    out["nfe_per_answer"] = round(sum(r.nfe for r in results) / max(len(results), 1), 1)
    return out


def _valid(text: str, schema: dict[str, Any], jsonschema: Any) -> bool | None:
    """None where the text is not JSON; else whether the schema as given accepts it."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def render_structured(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    hw = report["hardware"]
    title = (
        f"structured output: {report['requests']} extraction requests over {len(report['schemas'])} schemas, "
        f"gen {report['gen_length']}, batch {report['batch_size']}, {report['model']} ({report['strategy']}), "
        f"{report['device']} {report['dtype']}, {hw.get('cpu', '')}"
    )
    table = Table(title=title)
    for c in ("way", "requests", "parses", "validates", "stop", "length", "tokens/s", "NFE/answer", "wall s"):
        table.add_column(c)
    for r in report["rows"]:
        n = max(r["answers"], 1)
        table.add_row(
            r["way"] + (f" ({r['pinned']} pinned)" if r["way"] == "template" else ""), str(r["answers"]),
            f"{r['parses'] / n:.3f}", f"{r['validates'] / n:.3f}", str(r["stop"]), str(r["length"]),
            f"{r['tokens_per_s']:.1f}", f"{r['nfe_per_answer']:.1f}", f"{r['wall_s']:.1f}",
        )  # fmt: skip
    console = Console(width=max(Console().width, 120))
    console.print(table)
    loose = [name for name, s in report["schemas"].items() if not s["pinned"]]
    if loose:
        console.print(
            f"in the template row, {', '.join(loose)} (no fixed shape, or a template longer than gen "
            f"{report['gen_length']}) decode left to right"
        )
