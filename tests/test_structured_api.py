"""Structured output and log probabilities in `celeris serve` (issue 45), with the real `openai` client against
a real server on the default embedded model: `response_format` and `structured_outputs` answers that finish
"stop" always parse, validate and match; what cannot be honoured is a 400 naming it; `logprobs` come one per
output token in chat's and the legacy completions endpoint's shapes and change no answer; the Batch API's
output lines carry them too."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from .serve_helpers import Server
from .test_serve_batch import Queue, line

MODEL = "celeris-block"
BASE = ("--model", MODEL, "--device", "cpu", "--dtype", "float32")
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
            "where": {
                "type": "object",
                "properties": {"floor": {"type": "integer", "minimum": -2, "maximum": 40}},
                "required": ["floor"],
            },
        },
        "required": ["code", "tags", "where"],
    },
]
PROMPTS = ["Extract the user: Ada, 36, admin.", "Ticket ABC-12, tags red and big, floor 3.", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    s = Server(*BASE, "--max-tokens", "128", "--batch-size", "8", log=root / "serve.log").start()
    yield s
    s.stop()


def _schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def test_every_stop_answer_to_a_response_format_parses_and_validates(server: Server) -> None:
    client = server.client()
    finished = 0
    for schema in SCHEMAS:
        for seed, prompt in enumerate(PROMPTS):
            r = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                response_format=_schema_format(schema),
                max_tokens=128,
                seed=seed,
            )
            choice = r.choices[0]
            text = choice.message.content or ""
            if choice.finish_reason == "stop":
                finished += 1
                jsonschema.validate(json.loads(text), schema)  # never "stop" while invalid
            else:
                assert choice.finish_reason == "length" and "structured_outputs" in (choice.model_extra or {})["error"]
    assert finished >= len(SCHEMAS) * len(PROMPTS) - 1
    # a legacy completion with json_object: an object, or "length" with the error
    r2 = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=64, extra_body={"response_format": {"type": "json_object"}}
    )
    if r2.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r2.choices[0].text), dict)


def test_choice_and_regex_answers_always_match(server: Server) -> None:
    client = server.client()
    for seed, prompt in enumerate(PROMPTS):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, seed=seed,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
        )  # fmt: skip
        assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=32, seed=seed,
            extra_body={"structured_outputs": {"regex": "[a-z]{2,8}-[0-9]{3}"}},
        )  # fmt: skip
        assert re.fullmatch("[a-z]{2,8}-[0-9]{3}", chat.choices[0].message.content or ""), chat


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "colour": 1}}},
            "colour",
        ),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "frobnicate": 1}, "frobnicate"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
        ({"structured_outputs": {"regex": "a+"}, "stop": ["x"]}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "stream": True}, "logprobs"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(server: Server, extra: dict[str, Any], named: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **extra}
    status, answer = server.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and named in answer["error"]["message"], answer


@pytest.mark.parametrize("regex", ["(a{1000}){1000}", "a{1000000}"])
def test_a_constraint_past_its_budget_is_a_400_naming_it(server: Server, regex: str) -> None:
    """Issue 56: about a hundred bytes that would keep the grammar engine busy for seconds are a 400 before
    the request is admitted, given with a text prompt or with token ids."""
    for prompt in ("x", [5, 6, 7]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "structured_outputs": {"regex": regex}}
        status, answer = server.post("/v1/completions", json.dumps(body).encode())
        assert status == 400 and "structured_outputs.regex" in answer["error"]["message"], answer


def test_a_constraint_given_with_token_ids_is_built_before_it_is_admitted(server: Server) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "structured_outputs": {"regex": "(a"}}
    status, answer = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 400 and "structured_outputs" in answer["error"]["message"], answer


def test_max_constraint_chars_bounds_a_constraint(tmp_path: Path) -> None:
    s = Server(*BASE, "--max-tokens", "16", "--max-constraint-chars", "100", log=tmp_path / "serve.log").start()
    try:
        small = {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}
        large = {"json": {**small["json"], "description": "x" * 100}}
        answers = []
        for constraint in (small, large):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 16, "structured_outputs": constraint}
            answers.append(s.post("/v1/completions", json.dumps(body).encode()))
    finally:
        s.stop()
    assert answers[0][0] == 200, answers[0]
    status, answer = answers[1]
    assert status == 400 and "--max-constraint-chars" in answer["error"]["message"], answer


def _check_entries(entries: list[Any], text: str, completion_tokens: int, top: int) -> None:
    assert len(entries) == completion_tokens > 0
    assert "".join(e["token"] for e in entries) == text
    for e in entries:
        assert math.isfinite(e["logprob"]) and e["logprob"] <= 0
        alternatives = e["top_logprobs"]
        assert len(alternatives) == top
        best = max(alternatives, key=lambda t: t["logprob"])
        if best["logprob"] <= e["logprob"] + 1e-6:  # the chosen token was the most probable: it is among them
            assert e["token"] in [t["token"] for t in alternatives]


def test_logprobs_come_one_per_output_token_in_both_shapes_and_change_no_answer(server: Server) -> None:
    client = server.client()
    for seed, prompt in enumerate(PROMPTS):
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, seed=seed, temperature=0)
        logged = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, seed=seed, temperature=0, logprobs=3
        )
        c = logged.choices[0]
        assert (c.text, c.finish_reason) == (plain.choices[0].text, plain.choices[0].finish_reason)
        assert plain.choices[0].logprobs is None and c.logprobs is not None
        lp = c.logprobs
        assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        entries = [
            {"token": t, "logprob": v, "top_logprobs": [{"token": k, "logprob": w} for k, w in alt.items()]}
            for t, v, alt in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
        ]
        assert logged.usage is not None
        _check_entries(entries, c.text, logged.usage.completion_tokens, len(lp.top_logprobs[0]))
        assert all(1 <= len(alt) <= 3 for alt in lp.top_logprobs)  # tokens spelled alike share a key
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            seed=seed,
            temperature=0,
            logprobs=True,
            top_logprobs=3,  # type: ignore[arg-type]
        )
        ch = chat.choices[0]
        assert ch.message.content == plain.choices[0].text  # the same answer: chat without a template is its text
        assert ch.logprobs is not None and ch.logprobs.content is not None and chat.usage is not None
        _check_entries(
            [e.model_dump() for e in ch.logprobs.content], ch.message.content or "", chat.usage.completion_tokens, 3
        )


def test_logprobs_under_a_constraint_are_after_its_mask(server: Server) -> None:
    r = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, logprobs=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    assert set(lp.top_logprobs[0]) <= {"y", "n", "yes", "no", "ye"}  # only what the grammar allows begins it


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queue]:
    q = Queue(tmp_path_factory.mktemp("queue"))
    yield q
    q.server.stop()
    if q.watch is not None:
        q.watch.stop()


def test_a_batch_carries_response_format_and_logprobs_into_its_output_lines(queue: Queue, tmp_path: Path) -> None:
    url = "/v1/chat/completions"
    schema = SCHEMAS[0]
    lines = [
        line(f"s{i}", p, i, url, max_tokens=96, response_format=_schema_format(schema)) for i, p in enumerate(PROMPTS)
    ]
    lines.append(line("lp", PROMPTS[2], 7, url, max_tokens=12, logprobs=True, top_logprobs=2))
    lines.append(line("bad", PROMPTS[2], 7, url, structured_outputs={"regex": "(a"}))
    file_id = queue.upload(lines)
    queue.start_watch()
    batch = queue.client.batches.create(input_file_id=file_id, endpoint=url, completion_window="24h")
    done = queue.wait(batch.id, "completed", "failed")
    assert done.status == "completed", done
    out = {x["custom_id"]: x["response"]["body"] for x in queue.lines(done.output_file_id)}
    for i in range(len(PROMPTS)):
        choice = out[f"s{i}"]["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        else:
            assert "structured_outputs" in choice["error"]
    lp = out["lp"]["choices"][0]
    _check_entries(lp["logprobs"]["content"], lp["message"]["content"], out["lp"]["usage"]["completion_tokens"], 2)
    (err,) = queue.lines(done.error_file_id)
    assert err["custom_id"] == "bad" and "structured_outputs" in err["error"]["message"]


def test_a_static_batch_strategy_holds_its_constraint_and_reports_logprobs(server: Server) -> None:
    """The block strategy decodes in static batches (the runner's other path), with the same rules."""
    r = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, logprobs=2,
        extra_body={"strategy": "block", "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "stop" and re.fullmatch("[A-Z]{3}-[0-9]{2}", c.text), c
    assert c.logprobs is not None and c.logprobs.tokens is not None and "".join(c.logprobs.tokens) == c.text


def test_a_streamed_answer_that_ran_out_says_why_in_its_last_event(server: Server) -> None:
    stream = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=8, stream=True,
        extra_body={"structured_outputs": {"regex": "a{40}"}},
    )  # fmt: skip
    events = list(stream)
    last = events[-1].choices[0]
    assert last.finish_reason == "length" and "structured_outputs" in (last.model_extra or {})["error"]
    assert re.fullmatch("a*", "".join(e.choices[0].text for e in events))


def test_the_values_that_ask_for_nothing_pass_and_a_legacy_body_takes_no_top_logprobs(server: Server) -> None:
    base = {"model": MODEL, "prompt": "The quick", "max_tokens": 4, "seed": 1}
    plain = server.post("/v1/completions", json.dumps(base).encode())
    neutral = {**base, "logprobs": False, "response_format": {"type": "text"}}
    status, answer = server.post("/v1/completions", json.dumps(neutral).encode())
    assert status == 200 and answer["choices"][0]["text"] == plain[1]["choices"][0]["text"], answer
    assert answer["choices"][0]["logprobs"] is None
    both = {**base, "logprobs": 1, "top_logprobs": 4}
    status, answer = server.post("/v1/completions", json.dumps(both).encode())
    assert status == 400 and "top_logprobs" in answer["error"]["message"]


def test_legacy_logprobs_spell_pieces_of_a_character_as_bytes(server: Server) -> None:
    text = "日本é"
    r = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, logprobs=2,
        extra_body={"structured_outputs": {"choice": [text]}},
    )  # fmt: skip
    c = r.choices[0]
    assert c.text == text and c.logprobs is not None and c.logprobs.tokens is not None
    tokens, offsets = c.logprobs.tokens, c.logprobs.text_offset or []
    spelled = b"".join(
        bytes(int(h, 16) for h in t[len("bytes:") :].split("\\x")[1:]) if t.startswith("bytes:") else t.encode()
        for t in tokens
    )
    assert spelled.decode() == text and all(0 <= o < len(text) for o in offsets) and offsets == sorted(offsets)
