"""The command line's constraint flags (issue 45): `--json-schema FILE`, `--regex`, `--choice` (repeatable),
and `--response-format` in OpenAI's spelling beside `--structured-outputs` in vLLM's, each an error naming
both flags when two are given, on the default embedded model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
from typer.testing import CliRunner

from celeris_cli.cli import app

runner = CliRunner()
PROMPTS = ["--prompt", "Extract the person: Ada Lovelace, 36.", "--prompt", "Bob is 7.", "--prompt", "The fox"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


def answers(*args: str) -> list[dict]:  # type: ignore[type-arg]
    r = runner.invoke(app, ["generate", *PROMPTS, "--device", "cpu", "--dtype", "float32", "--json", *args])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    return out if isinstance(out, list) else [out]


def test_choice_regex_and_json_schema_flags_hold_every_answer(tmp_path: Path) -> None:
    chosen = answers("--choice", "yes", "--choice", "no", "--choice", "maybe")
    assert all(a["text"] in ("yes", "no", "maybe") and a["finish_reason"] == "stop" for a in chosen)
    free = answers()
    assert not all(a["text"] in ("yes", "no", "maybe") for a in free)  # the flag, not chance, holds them
    pattern = "[0-9]{3}-[a-z]{2,5}"
    for a in answers("--regex", pattern):
        assert a["finish_reason"] == "stop" and re.fullmatch(pattern, a["text"]), a["text"]
    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMA))
    for a in answers("--json-schema", str(path), "--gen-length", "48"):
        assert a["finish_reason"] == "stop", a
        jsonschema.validate(json.loads(a["text"]), SCHEMA)
        assert a["settings"]["structured_outputs"] == json.dumps({"json": SCHEMA}, separators=(",", ":"))


def test_response_format_takes_openai_spelling_and_structured_outputs_vllm() -> None:
    openai = json.dumps({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    via_openai = answers("--response-format", openai, "--gen-length", "48")
    via_vllm = answers("--structured-outputs", json.dumps({"json": SCHEMA}), "--gen-length", "48")
    assert [a["text"] for a in via_openai] == [a["text"] for a in via_vllm]
    r = runner.invoke(app, ["generate", "-p", "x", "--structured-outputs", openai])
    assert r.exit_code == 2 and "structured_outputs.type" in r.output  # vLLM's spelling has no "type"


def test_two_constraints_are_an_error_naming_both(tmp_path: Path) -> None:
    for args, named in [
        (["--regex", "a+", "--choice", "b"], ("--regex", "--choice")),
        (["--choice", "b", "--structured-outputs", '{"regex": "a"}'], ("--choice", "--structured-outputs")),
        (
            ["--response-format", '{"type": "json_object"}', "--structured-outputs", '{"regex": "a"}'],
            ("--response-format", "--structured-outputs"),
        ),
    ]:
        r = runner.invoke(app, ["generate", "-p", "x", *args])
        assert r.exit_code == 2 and all(n in r.output for n in named), r.output


def test_a_schema_file_that_cannot_be_read_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, said in [(tmp_path / "missing.json", "cannot read"), (bad, "not JSON")]:
        r = runner.invoke(app, ["generate", "-p", "x", "--json-schema", str(path)])
        assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, r.output


def test_a_constraint_past_its_budget_is_an_error_naming_it(tmp_path: Path) -> None:
    """Issue 56: a hundred bytes of regex that would cost the grammar engine seconds are refused at once."""
    for regex in ("(a{1000}){1000}", "a{1000000}"):
        r = runner.invoke(app, ["generate", "--prompt", "x", "--regex", regex])
        assert r.exit_code == 2 and r.output.startswith("Error: structured_outputs.regex"), r.output
    schema = tmp_path / "oneof.json"
    schema.write_text(
        '{"oneOf":[{"type":"object","properties":{"a":{"type":"boolean"}},"required":["a"]},'
        '{"type":"object","properties":{"b":{"type":"boolean"}}}]}'
    )
    r = runner.invoke(app, ["generate", "--prompt", "x", "--json-schema", str(schema)])
    assert r.exit_code == 2 and "Error: " in r.output and "oneOf" in r.output, r.output


def test_a_constraint_on_the_diffusion_default_runs_under_the_models_strategy_that_holds_it() -> None:
    """The default model decodes by diffusion (`nemotron`), which holds no constraint: with no strategy chosen,
    the model's first strategy that honours every setting asked (`spec`) runs it; a strategy chosen by name is
    never swapped, and one that cannot honour the constraint is refused by name."""
    r = runner.invoke(app, ["generate", "--prompt", "x", "--regex", "[a-z]{4}", "--gen-length", "8", "--jsonl"])
    assert r.exit_code == 0, r.output
    answer = json.loads(r.stdout.splitlines()[0])
    assert answer["settings"]["strategy"] == "spec" and re.fullmatch("[a-z]{4}", answer["text"])
    plain = runner.invoke(app, ["generate", "--prompt", "x", "--gen-length", "8", "--jsonl"])
    assert json.loads(plain.stdout.splitlines()[0])["settings"]["strategy"] == "nemotron"
    chosen = ["generate", "--prompt", "x", "--regex", "[a-z]{4}", "--strategy", "nemotron"]
    refused = runner.invoke(app, chosen)
    assert refused.exit_code == 2 and "not used by the nemotron strategy" in refused.output
