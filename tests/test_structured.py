"""Structured output in the decoders (issue 45): answers under a constraint always parse and match, a dead end
is never reported as "stop", the commit rule keeps a row's parallel commits only while the grammar accepts
them, an answer is the same alone and beside other rows (rule 2), and log probabilities come one per output
token from the distribution that committed it."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from celeris_cli.constraints import canonical
from celeris_cli.engine import Engine, load_engine
from celeris_cli.errors import UsageError
from celeris_cli.structured.commit import Record, Rule, settle
from celeris_cli.structured.grammar import Grammar
from celeris_cli.structured.template import TooLong, shape

PROMPTS = [
    "Extract the person as JSON: Ada Lovelace, 36, mathematician.",
    "The quick brown fox",
    "Bob is 7 and likes trains and boats.",
    "床前明月光，",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["engineer", "poet", "mathematician"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "job", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def block() -> Engine:
    return load_engine("celeris-block", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return load_engine("celeris-tiny", device="cpu", dtype="float32")


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("model", ["block", "tiny"])
def test_every_stop_answer_under_a_schema_parses_and_validates(model: str, request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(model)
    params = engine.params({"structured_outputs": {"json": PERSON}, "gen_length": 128, "seed": 3})
    results = engine.generate(PROMPTS * 2, params, batch_size=4, seeds=list(range(8)))
    stops = [r for r in results if r.finish_reason == "stop"]
    assert len(stops) >= 6, [(r.text, r.finish_reason, r.error) for r in results]
    for r in results:
        if r.finish_reason == "stop":
            assert _valid(r.text, PERSON), r.text
            assert r.error is None
        else:
            assert r.error is not None and "structured_outputs" in r.error


def test_unconstrained_answers_of_the_same_requests_do_not_parse(block: Engine) -> None:
    """The embedded model does not write valid JSON by itself: the constraint is what makes the answers valid."""
    results = block.generate(PROMPTS * 2, block.params({"gen_length": 128}), batch_size=4, seeds=list(range(8)))
    assert not any(_valid(r.text, PERSON) for r in results)


def test_choice_and_regex_answers_always_match(block: Engine, tiny: Engine) -> None:
    for engine in (block, tiny):
        choice = engine.params({"structured_outputs": {"choice": ["yes", "no", "not sure"]}})
        for r in engine.generate(PROMPTS, choice, seeds=[1, 2, 3, 4]):
            assert r.finish_reason == "stop" and r.text in ("yes", "no", "not sure"), r.text
        pattern = "[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{1,6})?"
        regex = engine.params({"structured_outputs": {"regex": pattern}})
        for r in engine.generate(PROMPTS, regex, seeds=[1, 2, 3, 4]):
            assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


def test_a_lark_grammar_and_json_object(block: Engine) -> None:
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/\n'
    for r in block.generate(PROMPTS, block.params({"structured_outputs": {"grammar": lark}})):
        assert r.finish_reason == "stop" and re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", r.text), r.text
    params = block.params({"response_format": {"type": "json_object"}, "gen_length": 96})
    for r in block.generate(PROMPTS, params):
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict), r.text


def test_the_static_block_strategy_is_constrained_too(block: Engine) -> None:
    params = block.params({"strategy": "block", "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,5}"}})
    for r in block.generate(PROMPTS, params, scheduling="static"):
        assert r.finish_reason == "stop" and re.fullmatch("[0-9]{3}-[a-z]{2,5}", r.text), r.text


@pytest.mark.parametrize("model", ["block", "tiny"])
def test_an_answer_under_a_constraint_is_the_same_alone_and_beside_others(
    model: str, request: pytest.FixtureRequest
) -> None:
    """Rule 2: constrained and free rows, different constraints, widths 1 and 4, in one running set."""
    engine: Engine = request.getfixturevalue(model)
    kinds = [
        {"structured_outputs": {"json": PERSON}, "gen_length": 96},
        {"gen_length": 96},
        {"structured_outputs": {"regex": "[a-z]+( [a-z]+){2,4}"}, "gen_length": 96},
        {"structured_outputs": {"json": PERSON}, "gen_length": 96, "logprobs": True, "top_logprobs": 2},
    ]
    params = [engine.params_for(p, engine.params(k)) for p, k in zip(PROMPTS, kinds)]
    encoded = [engine.encode_prompt(p) for p in PROMPTS]
    seeds = [5, 6, 7, 8]
    together = engine.decode_running(PROMPTS, encoded, params, seeds, 4)
    for i in range(4):
        [alone] = engine.decode_running(PROMPTS[i : i + 1], encoded[i : i + 1], params[i : i + 1], seeds[i : i + 1], 1)
        assert (alone.text, alone.finish_reason, alone.logprobs) == (
            together[i].text,
            together[i].finish_reason,
            together[i].logprobs,
        )


def test_a_static_block_row_is_the_same_alone_and_beside_rows_of_other_schedules(block: Engine) -> None:
    """Rule 2 in the static block decoder: prompts of different lengths have different steps in their first
    block; a constrained row past its own steps commits as it does alone, whatever its batch mates' steps."""
    prompts = ["Hi", "Extract the person as JSON: Ada", "Bob is 7 a"]
    params = block.params(
        {"strategy": "block", "structured_outputs": {"json": PERSON}, "gen_length": 96, "denoise_steps": 96}
    )
    assert len({tuple(params.steps_for(len(block.encode_prompt(p)))) for p in prompts}) > 1
    together = block.generate(prompts, params, seeds=[3, 4, 5], scheduling="static")
    for i, r in enumerate(together):
        [alone] = block.generate(prompts[i : i + 1], params, seeds=[3 + i], scheduling="static")
        assert (alone.text, alone.finish_reason) == (r.text, r.finish_reason)


def test_a_row_under_a_schema_commits_several_tokens_a_step(block: Engine) -> None:
    """The schema's fixed parts are laid down with the model's picks: far fewer forwards than tokens."""
    params = block.params({"structured_outputs": {"json": PERSON}, "gen_length": 128, "temperature": 0.0})
    [r] = block.generate([PROMPTS[0]], params)
    assert r.finish_reason == "stop"
    assert r.nfe < 0.75 * r.output_tokens, (r.nfe, r.output_tokens)


# -- the commit rule, on the step's own pieces ----------------------------------------------------------


@dataclass(frozen=True)
class _Logits:
    """A step's logits over its masked positions (row order), as `StepLogits` is called."""

    rows: torch.Tensor
    shape: None = None

    def __call__(self, part: slice) -> torch.Tensor:
        return self.rows[part]


def _step(engine: Engine, spec: dict[str, Any], text: str, wanted: str, chosen: int) -> tuple[str, Rule]:
    """One commit step of a row whose block is all masked: the model proposes `wanted`'s tokens in order, the
    step chose the first `chosen` positions; returns the committed text."""
    vocab = engine.vocabulary()
    rule = Rule(Grammar(canonical("structured_outputs", spec), vocab), Record(2))
    for t in vocab.tokens_of(text):
        assert rule.grammar is not None and rule.grammar.take(t)
    ids = vocab.tokens_of(wanted)
    W, mask = len(ids) + 2, engine.tokenizer.mask_id
    block_ = torch.full((1, W), mask)
    proposal = block_.clone()
    proposal[0, : len(ids)] = torch.tensor(ids)
    logits = torch.full((W, vocab.rows), -5.0)
    for c, t in enumerate(ids):
        logits[c, t] = 5.0
    picked = torch.zeros(1, W, dtype=torch.bool)
    picked[0, :chosen] = True

    def one(scores: torch.Tensor, i: int) -> torch.Tensor:
        return scores.argmax(-1)

    out = settle(block_, proposal, picked, _Logits(logits), one, [rule], [0], mask)
    got = [int(t) for t in out[0] if int(t) != mask]
    return "".join(vocab.text(t) for t in got), rule


def test_the_chosen_positions_commit_in_order_while_the_grammar_accepts(block: Engine) -> None:
    spec = {"regex": "[a-z]+-[0-9]+"}
    n = len(block.vocabulary().tokens_of("ab-12"))
    assert n >= 3
    assert _step(block, spec, "", "ab-12", chosen=n)[0] == "ab-12"  # every chosen position, in order
    first = block.vocabulary().text(block.vocabulary().tokens_of("ab-12")[0])
    assert _step(block, spec, "", "ab-12", chosen=1)[0] == first  # the step chose one: the leftmost only
    assert _step(block, spec, "", "a1-2", chosen=4)[0] == "a"  # "1" after a letter: nothing from it on


def test_what_the_grammar_alone_decides_is_laid_down_without_the_model(block: Engine) -> None:
    """After "{", a schema of one required key forces its key, quote and colon: they commit in the same step
    even where the step chose only the leftmost position (the value's opening quote belongs to the value)."""
    spec = {"json": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    text, _ = _step(block, spec, "", '{"city":"', chosen=1)
    assert text in ('{"city":', '{"city":"')


def test_the_leftmost_position_is_decided_under_the_mask(block: Engine) -> None:
    """The model proposes a digit where the grammar wants a letter: the leftmost position takes the likeliest
    allowed token instead, and the invalid proposal never commits."""
    text, rule = _step(block, {"regex": "[a-z]+"}, "", "1abc", chosen=4)
    assert re.fullmatch("[a-z]+", text), text
    assert rule.record is not None and all(math.isfinite(v[1]) and v[1] <= 0 for v in rule.record.at.values())


def test_a_dead_end_ends_the_answer_as_length_with_an_error(block: Engine) -> None:
    class Stuck(Grammar):
        def allowed(self, device: torch.device) -> torch.Tensor:
            return torch.zeros(self.vocab.rows, dtype=torch.bool)

    engine = block
    params = engine.params({"structured_outputs": {"regex": "[a-z]+"}})
    rule = Rule(Stuck(params.structured_outputs or "", engine.vocabulary()))
    ids = engine.encode_prompt(PROMPTS[1])
    outs, _ = engine.decode_ids([ids], params, rules=[rule])
    answer = engine.outcome(outs[0], params, ids, rule)
    assert answer.finish_reason == "length" and answer.error is not None and "dead end" in answer.error
    assert answer.text == ""


def test_an_answer_cut_by_its_length_is_length_with_an_error(block: Engine) -> None:
    params = block.params({"structured_outputs": {"regex": "a{40}"}, "gen_length": 8, "block_length": 8})
    [r] = block.generate([PROMPTS[1]], params)
    assert r.finish_reason == "length" and r.error is not None and "8 tokens" in r.error
    assert re.fullmatch("a*", r.text)


def test_min_tokens_yields_to_the_grammar(block: Engine) -> None:
    """A choice of one token cannot wait for min_tokens: the grammar's end wins over the shaping's ban."""
    params = block.params({"structured_outputs": {"choice": ["no"]}, "min_tokens": 8})
    [r] = block.generate(["The quick brown fox"], params)
    assert (r.text, r.finish_reason) == ("no", "stop")


# -- log probabilities ------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"structured_outputs": {"json": PERSON}, "gen_length": 128}])
def test_logprobs_come_one_per_output_token_and_do_not_change_the_answer(block: Engine, extra: dict[str, Any]) -> None:
    base = {"temperature": 0.0, **extra}
    plain = block.generate(PROMPTS, block.params(base), seeds=[1, 2, 3, 4])
    logged = block.generate(PROMPTS, block.params({**base, "logprobs": True, "top_logprobs": 3}), seeds=[1, 2, 3, 4])
    vocab = block.vocabulary()
    for a, b in zip(plain, logged):
        assert (a.text, a.finish_reason) == (b.text, b.finish_reason)
        assert a.logprobs is None and b.logprobs is not None
        assert len(b.logprobs) == b.output_tokens
        assert "".join(e["token"] for e in b.logprobs) == b.text
        for e in b.logprobs:
            assert math.isfinite(e["logprob"]) and e["logprob"] <= 0
            # three alternatives, or fewer where the constraint allows fewer tokens
            assert len(e["top_logprobs"]) == 3 or (extra and 1 <= len(e["top_logprobs"]) < 3)
            top = e["top_logprobs"][0]
            assert top["logprob"] >= e["logprob"] - 1e-6
            # greedy: the chosen token is the likeliest of the distribution it was committed from
            assert top["token"] == e["token"] or math.isclose(top["logprob"], e["logprob"], abs_tol=1e-6)
            assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
    assert vocab.size > 0


def test_top_logprobs_zero_gives_no_alternatives(block: Engine) -> None:
    [r] = block.generate([PROMPTS[1]], block.params({"logprobs": True}))
    assert r.logprobs is not None and all(e["top_logprobs"] == [] for e in r.logprobs)


# -- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"strategy": "dream", "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"strategy": "reference", "logprobs": True}, "logprobs"),
        ({"structured_outputs": {"regex": "a"}, "stop": ["x"]}, "stop"),
        ({"structured_outputs": {"regex": "a"}, "edit_threshold": 0.5}, "edit_threshold"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}}, "extra"),
        ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "edit_threshold": 0.5}, "edit_threshold"),
        ({"structured_outputs": {"regex": "a"}, "stop_token_ids": [5]}, "stop_token_ids"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(block: Engine, settings: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError, match=named):
        block.params(settings)


def test_editing_given_after_the_constraint_is_refused_too(block: Engine) -> None:
    """A layer that turns editing on under a constraint another layer set (a request over a config's
    `generation:`) is refused as the same settings in one layer are."""
    params = block.params({"structured_outputs": {"regex": "a"}})
    with pytest.raises(UsageError, match="edit_threshold"):
        params.with_(edit_threshold=0.5)
    with pytest.raises(UsageError, match="stop_token_ids"):
        params.with_(stop_token_ids=[5])


def test_values_are_not_closed_and_merged_objects_stay_open(block: Engine) -> None:
    """Closing objects walks sub-schemas only: a `const` or `enum` holding an object is data, and must come
    back as written; an object whose properties combine with an `allOf` member's is left open (closed, each
    part would refuse the other's keys)."""
    literal = {"properties": {"a": 1}}
    schemas = [
        {"type": "object", "properties": {"v": {"const": literal}}, "required": ["v"]},
        {"type": "object", "properties": {"v": {"enum": [literal, 2]}}, "required": ["v"]},
        {
            "type": "object",
            "allOf": [{"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}],
            "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["b"],
        },
    ]
    for schema in schemas:
        params = block.params({"structured_outputs": {"json": schema}, "gen_length": 48})
        for r in block.generate(PROMPTS[:2], params, seeds=[0, 1]):
            assert r.finish_reason == "stop" and _valid(r.text, schema), r.text


def test_a_schema_nested_too_deeply_is_refused_by_name(block: Engine) -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(UsageError, match="nested more than 64"):
        block.params({"structured_outputs": {"json": deep}})
    with pytest.raises(UsageError, match="nested"):
        block.params({"structured_outputs": '{"json": ' + '{"items": ' * 5000 + "{}" + "}" * 5001})


def test_an_answer_that_fills_its_length_exactly_where_its_grammar_ends_is_stop(block: Engine) -> None:
    """Nine tokens spell {"a":"x"}: with gen_length 9 the answer is complete, not cut; with 8 it is cut (the
    row's canvas runs past gen_length to its block's end, so the verdict is the answer's own tokens')."""
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    for length, reason in ((9, "stop"), (8, "length")):
        params = block.params({"structured_outputs": {"json": schema}, "gen_length": length, "block_length": 8})
        [r] = block.generate(["Hi"], params)
        assert r.finish_reason == reason and (r.error is None) == (reason == "stop"), r
        assert r.text == '{"a":"x"}'[: len(r.text)] and (reason == "length" or _valid(r.text, schema))


def test_a_model_stop_id_that_is_an_ordinary_piece_never_cuts_a_constrained_answer(
    block: Engine, tmp_path: Path
) -> None:
    """A checkpoint whose generation_config.json makes an ordinary piece (here ▁the) an end of text: the
    grammar treats it as one (allowed only where the answer may end), so no answer is cut mid-grammar."""
    folder = tmp_path / "block"
    shutil.copytree(block.model_dir, folder)
    the = block.encode_prompt("the")[-1]
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, the]}))
    engine = load_engine(folder, device="cpu", dtype="float32")
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 30, "maxLength": 40}}}
    params = engine.params({"structured_outputs": {"json": {**schema, "required": ["name"]}}, "gen_length": 64})
    results = engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
    for r in results:
        assert r.finish_reason != "stop" or _valid(r.text, schema), r.text
    assert sum(r.finish_reason == "stop" for r in results) >= 3


# -- template-pinned decoding -----------------------------------------------------------------------------

FIXED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["poet", "engineer", "mathematician"]},
        "ok": {"type": "boolean"},
        "point": {
            "type": "array",
            "items": {"type": "integer", "minimum": -9, "maximum": 9},
            "minItems": 2,
            "maxItems": 2,
        },
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "job", "ok", "point", "home"],
    "additionalProperties": False,
}


def test_which_schemas_have_a_fixed_shape() -> None:
    parts = shape(FIXED, 10**6)
    assert parts is not None and parts[0] == '{"name":' and parts[-1] == "}}"
    assert sum(isinstance(p, dict) for p in parts) == 7  # name, age, job, ok, two points, city
    assert shape(PERSON, 10**6) is None  # an array of unknown length, a string with a pattern
    optional = {**FIXED, "required": ["name"]}
    assert shape(optional, 10**6) is None
    assert shape({**FIXED, "additionalProperties": True}, 10**6) is None
    assert shape({"type": "integer", "minimum": 0}, 10**6) is None  # unbounded
    assert shape({"type": "string"}, 10**6) is None


@pytest.mark.parametrize("model", ["block", "tiny"])
def test_template_answers_validate_with_their_keys_in_order(model: str, request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(model)
    params = engine.params({"structured_outputs": {"json": FIXED}, "structured_layout": "template", "gen_length": 128})
    for r in engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4]):
        assert r.finish_reason == "stop", (r.text, r.error)
        assert _valid(r.text, FIXED), r.text
        assert list(json.loads(r.text)) == list(FIXED["properties"])
        assert r.text.startswith('{"name":"')


def test_structured_layout_changes_the_answer(block: Engine) -> None:
    texts = {}
    for layout in ("left-to-right", "template"):
        params = block.params({"structured_outputs": {"json": FIXED}, "structured_layout": layout, "gen_length": 128})
        [r] = block.generate([PROMPTS[0]], params)
        assert _valid(r.text, FIXED)
        texts[layout] = r.text
    assert texts["left-to-right"] != texts["template"]
    assert "  " in texts["template"] and "  " not in texts["left-to-right"]  # the slots' blanks


def test_a_template_row_is_the_same_alone_and_beside_others(tiny: Engine) -> None:
    kinds = [
        {"structured_outputs": {"json": FIXED}, "structured_layout": "template", "gen_length": 128},
        {"gen_length": 128},
        {"structured_outputs": {"json": FIXED}, "structured_layout": "left-to-right", "gen_length": 128},
        {"structured_outputs": {"json": FIXED}, "gen_length": 128, "logprobs": True},
    ]
    params = [tiny.params_for(p, tiny.params(k)) for p, k in zip(PROMPTS, kinds)]
    encoded = [tiny.encode_prompt(p) for p in PROMPTS]
    together = tiny.decode_running(PROMPTS, encoded, params, [1, 2, 3, 4], 4)
    for i in range(4):
        [alone] = tiny.decode_running(PROMPTS[i : i + 1], encoded[i : i + 1], params[i : i + 1], [i + 1], 1)
        assert (alone.text, alone.logprobs) == (together[i].text, together[i].logprobs)
    assert together[3].logprobs is not None and len(together[3].logprobs) == together[3].output_tokens


def _cube(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "boolean"}
    for _ in range(3):
        schema = {"type": "array", "items": schema, "minItems": n, "maxItems": n}
    return schema


def test_a_template_is_sized_by_arithmetic_before_it_is_laid_out(block: Engine) -> None:
    """Rule 5: a 1000 x 1000 x 1000 array (a few dozen bytes of schema) is refused by its size, never expanded."""
    with pytest.raises(TooLong):
        shape(_cube(40), 64)  # 64,000 leaves: expanding them would return a list, not raise
    assert shape(_cube(2), 64) is not None
    settings = {"structured_outputs": {"json": _cube(1000)}, "structured_layout": "template"}
    with pytest.raises(UsageError, match="gen_length"):
        block.params(settings)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"structured_outputs": {"json": PERSON}, "structured_layout": "template"}, "structured_layout"),
        ({"structured_outputs": {"regex": "a+"}, "structured_layout": "template"}, "structured_layout"),
        ({"structured_outputs": {"json": FIXED}, "structured_layout": "template", "gen_length": 32}, "gen_length"),
        ({"structured_layout": "template"}, "structured_layout"),
    ],
)
def test_a_template_that_cannot_be_laid_is_refused_by_name(block: Engine, settings: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError, match=named):
        block.params(settings)


def test_objects_that_say_nothing_of_other_keys_get_none(block: Engine) -> None:
    """Without additionalProperties a schema allows any other key; the grammar closes such objects (a subset
    of the same documents), so the model cannot spend its answer inventing keys."""
    open_schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$", "maxLength": 6}},
        "required": ["code"],
    }
    params = block.params({"structured_outputs": {"json": open_schema}, "gen_length": 128})
    results = block.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert all(r.finish_reason == "stop" for r in results), [r.text for r in results]
    for r in results:
        assert _valid(r.text, open_schema) and list(json.loads(r.text)) == ["code"], r.text


# -- DiffusionGemma's canvases ----------------------------------------------------------------------------

GEMMA = "tests/data/diffusion_gemma/diffusion_gemma_tiny"


@pytest.fixture(scope="module")
def gemma() -> Engine:
    return load_engine(GEMMA, device="cpu", dtype="float32")


def test_canvas_answers_match_and_are_the_same_alone_and_beside_others(gemma: Engine) -> None:
    pattern = "the [a-z]{2,9} (cat|dog)"
    prompts = ["hello there", "the cat", "a dog sat", "why"]
    constrained = gemma.params({"structured_outputs": {"regex": pattern}, "gen_length": 32})
    free = gemma.params({"gen_length": 32})
    together = gemma.generate(prompts, constrained, seeds=[1, 2, 3, 4], batch_size=4)
    for i, r in enumerate(together):
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text
        [alone] = gemma.generate(prompts[i : i + 1], constrained, seeds=[i + 1])
        assert alone.text == r.text
    unconstrained = gemma.generate(prompts, free, seeds=[1, 2, 3, 4])
    assert [r.text for r in unconstrained] != [r.text for r in together]
    assert not any(re.fullmatch(pattern, r.text) for r in unconstrained)


def test_a_real_dead_end_ends_the_answer_as_length_with_an_error(gemma: Engine) -> None:
    """The tiny DiffusionGemma vocabulary has no "{": an answer that must go on with one after its first
    letters is stuck there, and ends as length with the error, the valid prefix as its text."""
    params = gemma.params({"structured_outputs": {"regex": "the [{]"}, "gen_length": 16})
    for r in gemma.generate(["hello there", "why"], params, seeds=[1, 2]):
        assert r.finish_reason == "length" and r.error is not None and "structured_outputs" in r.error, r
        assert "the ".startswith(r.text) or r.text == "the ", r.text


def test_a_constraint_the_vocabulary_cannot_spell_is_refused(gemma: Engine) -> None:
    """The tiny DiffusionGemma vocabulary has no "{": no JSON object can begin."""
    with pytest.raises(UsageError, match="no token"):
        gemma.params({"structured_outputs": {"json_object": True}})


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"structured_outputs": {"json": FIXED}, "structured_layout": "template"}, "structured_layout"),
    ],
)
def test_what_the_canvas_strategy_cannot_honour_is_refused(gemma: Engine, settings: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError, match=named):
        gemma.params(settings)
