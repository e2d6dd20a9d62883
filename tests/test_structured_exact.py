"""A constraint held exactly, and built within a budget before it is admitted (issues 57 and 56):

- the schema rewrite (`grammar.closed`) only narrows, and never touches what stands under `oneOf`, `not`, `if`;
  a `required` key that `properties` does not declare is allowed with any value;
- an answer is reported `stop` only where `jsonschema` validates it against the user's own schema (a grammar
  that allowed more is caught: its answer is `length` with the reason);
- a constraint whose regular expressions expand past the budget is refused by arithmetic, naming where, before
  the grammar engine sees it; a constraint is compiled once, where the request is checked, and a row's grammar
  is a copy of what that built."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from celeris_cli.engine import Engine, load_engine
from celeris_cli.errors import UsageError
from celeris_cli.structured import grammar
from celeris_cli.structured.budget import MAX_EXPANSION, expansion
from celeris_cli.structured.grammar import Grammar, closed
from celeris_cli.structured.valid import violation

ONE_OF = {
    "oneOf": [
        {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "boolean"}}},
    ]
}


@pytest.fixture(scope="module")
def block() -> Engine:
    return load_engine("celeris-block", device="cpu", dtype="float32")


def test_nothing_under_one_of_not_or_if_is_rewritten() -> None:
    assert closed(ONE_OF) == ONE_OF
    obj = {"type": "object", "properties": {"x": {"type": "integer"}}}
    for key in ("not", "if"):
        schema = {"type": "object", "properties": {"v": {key: obj}}}
        assert closed(schema)["properties"]["v"] == {key: obj}
        assert closed(schema)["additionalProperties"] is False  # the object outside is still closed
    counted = {"type": "array", "contains": obj, "maxContains": 1}
    assert closed(counted) == counted


def test_a_ref_under_one_of_keeps_the_whole_schema_as_written() -> None:
    """The part a `$ref` names may be closed elsewhere in the walk: with a `$ref` under `oneOf`, nothing is."""
    schema = {
        "$defs": {"thing": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "type": "object",
        "properties": {"p": {"oneOf": [{"$ref": "#/$defs/thing"}, {"type": "integer"}]}},
    }
    assert closed(schema) == schema
    plain = {**schema, "properties": {"p": {"anyOf": [{"$ref": "#/$defs/thing"}, {"type": "integer"}]}}}
    assert closed(plain)["$defs"]["thing"]["additionalProperties"] is False  # anyOf: narrowing narrows


def test_any_of_and_all_of_members_are_still_closed() -> None:
    member = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert closed({"anyOf": [member]})["anyOf"][0]["additionalProperties"] is False
    inner = {"type": "object", "properties": {"q": {"type": "object", "properties": {"z": {"type": "integer"}}}}}
    out = closed({"allOf": [inner, {"minProperties": 1}]})  # not mergeable: stays an allOf
    assert "additionalProperties" not in out["allOf"][0]  # combined with the other member: open
    assert out["allOf"][0]["properties"]["q"]["additionalProperties"] is False  # a value inside it: closed


def test_a_merged_all_of_member_keeps_its_type() -> None:
    """`{"allOf": [{"type": "object", "properties": ...}]}` merged: still only objects."""
    schema = {"properties": {"b": {"type": "integer"}}, "allOf": [{"type": "object", "properties": {"a": {}}}]}
    out = closed(schema)
    assert out["type"] == "object" and "allOf" not in out
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(5, out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(5, schema)


def test_a_required_key_properties_do_not_declare_is_declared_with_any_value() -> None:
    out = closed({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "top"]})
    assert out["properties"] == {"a": {"type": "integer"}, "top": {}} and out["additionalProperties"] is False


def test_the_issues_one_of_is_refused_by_name(block: Engine) -> None:
    with pytest.raises(UsageError, match="oneOf"):
        block.params({"structured_outputs": {"json": ONE_OF}})


def test_a_one_of_llguidance_can_hold_decodes_valid_answers(block: Engine) -> None:
    schema = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]}
    params = block.params({"structured_outputs": {"json": schema}, "gen_length": 16})
    results = block.generate(["A count:", "A word:"], params, seeds=[0, 1])
    assert any(r.finish_reason == "stop" for r in results)
    for r in results:
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), schema)


def test_a_required_key_without_a_declaration_decodes(block: Engine) -> None:
    schema = {"type": "object", "properties": {}, "required": ["top"]}
    params = block.params({"structured_outputs": {"json": schema}, "gen_length": 48})
    for r in block.generate(["Return a JSON object:"], params, seeds=[0]):
        assert r.text.startswith('{"top":'), r.text
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), schema)


def test_an_answer_the_grammar_allowed_but_the_schema_does_not_is_never_stop(
    block: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite that widened (here: `const` dropped) lets the grammar complete answers the user's schema
    refuses; the final check reports them `length` with the reason, never `stop`."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "const": 7}}, "required": ["n"]}

    def widened(s: Any) -> Any:
        n = {"type": "integer", "minimum": 0, "maximum": 99}
        return {"type": "object", "properties": {"n": n}, "required": ["n"], "additionalProperties": False}

    monkeypatch.setattr(grammar, "closed", widened)
    grammar.compiled.cache_clear()
    grammar._start.cache_clear()
    try:
        params = block.params({"structured_outputs": {"json": schema}, "gen_length": 24})
        results = block.generate(["A number:", "Count:", "n ="], params, seeds=[0, 1, 2])
    finally:
        grammar.compiled.cache_clear()
        grammar._start.cache_clear()
    wrong = [r for r in results if r.text.startswith('{"n":') and r.text != '{"n":7}' and r.text.endswith("}")]
    assert wrong, [r.text for r in results]  # the widened grammar did complete answers the schema refuses
    for r in results:
        if r.finish_reason == "stop":
            assert json.loads(r.text) == {"n": 7}
    for r in wrong:
        assert r.finish_reason == "length" and r.error is not None and "does not validate" in r.error, r


def test_the_final_check_reads_each_kind() -> None:
    spec = json.dumps({"json": {"type": "object", "properties": {"n": {"const": 7}}, "required": ["n"]}})
    assert violation(spec, '{"n":7}') is None
    assert "at n" in (violation(spec, '{"n":8}') or "")
    assert "not JSON" in (violation(spec, '{"n":') or "")
    assert violation(json.dumps({"json_object": True}), "[1]") is not None
    assert violation(json.dumps({"choice": ["yes", "no"]}), "maybe") is not None
    assert violation(json.dumps({"choice": ["yes", "no"]}), "no") is None
    assert violation(json.dumps({"regex": "[a-z]+"}), "123") is None  # no second implementation of its dialect


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        ({"regex": "(a{1000}){1000}"}, "structured_outputs.regex"),
        ({"regex": "a{1000000}"}, "structured_outputs.regex"),
        ({"regex": r"(\p{L}{1000}){1000}"}, "structured_outputs.regex"),  # Rust's syntax, sized all the same
        ({"json": {"type": "object", "properties": {"k": {"type": "string", "pattern": "x{20000}"}}}}, "k.pattern"),
        ({"json": {"type": "object", "patternProperties": {"^a{99999}$": {}}}}, "patternProperties"),
        ({"grammar": "start: /(b{500}){500}/"}, "structured_outputs.grammar"),
    ],
)
def test_a_constraint_past_the_budget_is_refused_naming_where(
    block: Engine, constraint: dict[str, Any], named: str
) -> None:
    with pytest.raises(UsageError, match="over the limit") as e:
        block.params({"structured_outputs": constraint})
    assert named in str(e.value)


def test_expansion_multiplies_nested_counts_and_passes_real_patterns() -> None:
    assert expansion("(a{1000}){1000}") == 1_000_000
    assert expansion("a{3}b{2,5}") == 8
    assert expansion("^[a-zA-Z0-9_]{1,500}$") <= 502
    assert expansion("^(?!.*://)(?=.{1,255}$)((.{1,63}\\.){1,127}(?![0-9]*$)[a-z0-9-]+\\.?)$") <= MAX_EXPANSION


def test_a_constraint_is_compiled_once_and_rows_copy_it(block: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked where a request is admitted (`Engine.params`), a constraint is built there; a row's grammar on
    the decoding thread is a copy of it, with no compile (`LLMatcher` is never constructed again)."""
    import llguidance

    spec = {"regex": "[a-z]{2,6} (cat|dog)"}
    params = block.params({"structured_outputs": spec, "gen_length": 16})
    built: list[Any] = []
    real = llguidance.LLMatcher

    def counting(*a: Any, **k: Any) -> Any:  # any other use of LLMatcher (a compile) fails the test too
        built.append(a)
        return real(*a, **k)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    assert params.structured_outputs is not None
    g = Grammar(params.structured_outputs, block.vocabulary())
    assert built == [] and g.allowed(block.device).any()
    results = block.generate(["a pet:"], params, seeds=[0])
    assert built == [] and results[0].text


def test_definitions_a_ref_combines_stay_open_and_the_schema_stays_satisfiable(block: Engine) -> None:
    """JSONSchemaBench's Github_easy o25976 and o55668, in small: two definitions joined by `allOf` (closed
    each alone, no object could be both), and one under an `anyOf` inside an `allOf` member."""
    defs = {
        "A": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]},
        "B": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
    }
    joined = {"definitions": defs, "allOf": [{"$ref": "#/definitions/A"}, {"$ref": "#/definitions/B"}]}
    nested = {"definitions": defs, "allOf": [{"$ref": "#/definitions/A"}, {"anyOf": [{"$ref": "#/definitions/B"}]}]}
    alone = {"definitions": defs, "type": "object", "properties": {"x": {"$ref": "#/definitions/A"}}}
    for schema in (joined, nested):
        assert "additionalProperties" not in json.dumps(closed(schema)["definitions"])
        block.params({"structured_outputs": {"json": schema}})  # satisfiable: admitted
    assert closed(alone)["definitions"]["A"]["additionalProperties"] is False  # a value: closed


def test_past_the_arithmetic_the_engine_s_own_budget_refuses_it_before_admission(
    block: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the arithmetic lifted, the constraint is still built and tried (its first masks) where it is
    checked, and llguidance's limit refuses it there: a 400, never a dead end on the decoding thread."""
    from celeris_cli.structured import budget

    monkeypatch.setattr(budget, "MAX_EXPANSION", 10**9)
    with pytest.raises(UsageError, match="within its budget"):
        block.params({"structured_outputs": {"regex": "a{1000000}"}})
