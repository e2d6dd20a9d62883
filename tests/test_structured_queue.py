"""Structured output and log probabilities through request lines (issue 45): `celeris batch` on the default
embedded model's left-to-right strategy (`--set '{"strategy": "spec"}'`: its diffusion default has no
structured output), OpenAI batch lines and simple lines, with `response_format`, `structured_outputs` and
`logprobs`; every answer reported "stop" parses and validates, none is "stop" while invalid; a constraint
that cannot be honoured is a failure record naming it, and its batch mates are served."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from celeris_cli.serve.schema import APIError, ChatBody, CompletionBody, to_requests
from celeris_cli.spool.formats import logprobs_of, parse_file

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "items": {"type": "array", "items": {"enum": ["pen", "cup", "hat"]}, "minItems": 1, "maxItems": 3},
            "paid": {"type": "boolean"},
        },
        "required": ["id", "items", "paid"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                "required": ["lat"],
            },
        },
        "required": ["city", "where"],
    },
}
PROMPTS = ["Extract as JSON: Ada Lovelace, 36.", "Order AB123: two pens, paid.", "Paris is at 48 north.", "Hi"]


def body_line(custom_id: str, prompt: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": prompt}], **body}}  # fmt: skip


def run_batch(tmp_path: Path, lines: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, dict]]:  # type: ignore[type-arg]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    p = subprocess.run(
        [sys.executable, "-m", "celeris_cli", "batch", "-i", str(src), "-o", str(out), "--device", "cpu",
         "--dtype", "float32", "--batch-size", "8", "--set", json.dumps({"strategy": "spec"})],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode in (0, 1), p.stderr
    results = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    failed_path = tmp_path / "out.jsonl.failed.jsonl"
    failed = (
        {f["custom_id"]: f for f in map(json.loads, failed_path.read_text().splitlines())}
        if failed_path.exists()
        else {}
    )
    return results, failed


def test_request_lines_hold_answers_to_their_schemas_and_name_what_they_cannot_honour(tmp_path: Path) -> None:
    lines, expect = [], {}
    for name, schema in SCHEMAS.items():
        for i, prompt in enumerate(PROMPTS):
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            lines.append(body_line(f"{name}-{i}", prompt, response_format=fmt, max_tokens=96, seed=i))
            expect[f"{name}-{i}"] = schema
    lines.append({"custom_id": "choice", "prompt": PROMPTS[0], "structured_outputs": {"choice": ["yes", "no"]}})
    lines.append({"custom_id": "regex", "prompt": PROMPTS[1], "structured_outputs": {"regex": "[a-z]{3,6}-[0-9]{2}"}})
    lines.append({"custom_id": "logprobs", "prompt": PROMPTS[2], "logprobs": True, "top_logprobs": 3})
    bad_key = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "colour": "red"}}
    lines.append(body_line("bad_key", PROMPTS[0], response_format=bad_key))
    lines.append(
        body_line("both", PROMPTS[0], response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    )
    lines.append({"custom_id": "bad_regex", "prompt": "x", "structured_outputs": {"regex": "(a"}})
    results, failed = run_batch(tmp_path, lines)

    stops = 0
    for cid, schema in expect.items():
        body = results[cid]
        if body["finish_reason"] == "stop":
            stops += 1
            jsonschema.validate(json.loads(body["text"]), schema)  # never "stop" while invalid
            assert "error" not in body
        else:
            assert "structured_outputs" in body["error"], body
    assert stops >= len(expect) * 3 // 4  # most answers finish within 96 tokens
    assert results["choice"]["text"] in ("yes", "no")
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", results["regex"]["text"])
    entries = results["logprobs"]["logprobs"]["content"]
    assert len(entries) == results["logprobs"]["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in entries) == results["logprobs"]["text"]
    assert set(failed) == {"bad_key", "both", "bad_regex"}
    assert "colour" in failed["bad_key"]["message"]
    assert "response_format" in failed["both"]["message"] and "structured_outputs" in failed["both"]["message"]
    assert failed["bad_regex"]["code"] == "bad_param" and "structured_outputs" in failed["bad_regex"]["message"]


@pytest.mark.parametrize(
    ("body", "settings"),
    [
        ({"logprobs": True, "top_logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
        ({"logprobs": 2}, {"logprobs": True, "top_logprobs": 2}),  # the completions endpoint's integer
        ({"logprobs": 0}, {"logprobs": True, "top_logprobs": 0}),
        ({"logprobs": False, "top_logprobs": 0}, {}),  # what OpenAI's clients send by default
        ({"top_logprobs": None}, {}),
        ({"logprobs": 2, "top_logprobs": 3}, "not both"),
        ({"top_logprobs": 3}, "needs logprobs"),
        ({"logprobs": 9}, "0 to 5"),
        ({"logprobs": "yes"}, "logprobs="),
    ],
)
def test_one_reading_of_an_openai_bodys_logprobs_for_the_queue_and_serve(body: dict[str, Any], settings: Any) -> None:
    got = logprobs_of(body)
    if isinstance(settings, str):
        assert isinstance(got, str) and settings in got
    else:
        assert got == settings
    # the queue's line and serve's body give the same verdict
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", **body}})
    requests, errors = parse_file("f.jsonl", line.encode() + b"\n", 10_000)
    if isinstance(settings, str):
        assert errors and settings in errors[0].message
    else:
        assert requests[0].params == settings
    legacy = isinstance(body.get("logprobs"), int) and not isinstance(body.get("logprobs"), bool)
    try:
        if legacy:  # the completions endpoint's integer; chat's boolean
            parsed: Any = CompletionBody.model_validate({"prompt": "x", **body})
        else:
            parsed = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        [(request, _)] = to_requests(parsed, "r", 64)
        assert not isinstance(settings, str) and request.params == settings
    except (APIError, ValidationError) as e:  # the body's types refuse some values before the reading does
        assert isinstance(settings, str), e


def test_the_preparer_without_weights_checks_a_constraint_as_the_engine_does() -> None:
    """The Ray daemon prepares lines without the weights (`Preparer.load`): the same ends of an answer as
    the engine's, a bad constraint in the config's `generation:` refused at startup, one in a line refused
    as the line is prepared."""
    from celeris_cli.engine import load_engine
    from celeris_cli.errors import ConfigError, UsageError
    from celeris_cli.spool.backend import Preparer
    from celeris_cli.spool.formats import Request

    engine = load_engine(None, device="cpu", dtype="float32")
    bare = Preparer.load(None, {"strategy": "spec"})
    assert bare.stops | engine.tokenizer.stop_ids == engine.answer_stops() == Preparer.of(engine, bare.base).stops
    with pytest.raises(ConfigError, match="structured_outputs"):
        Preparer.load(None, {"structured_outputs": {"regex": "(a"}})
    with pytest.raises(UsageError, match="structured_outputs"):
        bare.prepare(Request("a", 1, prompt="x", params={"structured_outputs": {"regex": "(a"}}))
    ok = bare.prepare(Request("b", 2, prompt="x", params={"structured_outputs": {"choice": ["yes"]}}))
    assert ok.group.structured_outputs == '{"choice":["yes"]}'
