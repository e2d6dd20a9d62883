"""`celeris bench structured`: the extraction workload decoded unconstrained, left to right and template-pinned
on the embedded block-diffusion model (celeris-block), one row each; the constrained rows' answers that
finish validate against their schemas as given, the counts add up, the template row pins the schemas of a
fixed shape that fit, and the scoring counts what it says (checked on answers written by hand). On the
default model's left-to-right strategy (`spec`) the template row pins nothing."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app
from celeris_cli.engine import Result
from celeris_cli.measure.structured import SCHEMAS, WAYS, _score, workload

runner = CliRunner()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """One tiny run on the embedded block-diffusion model: its table and its --out report."""
    out = tmp_path_factory.mktemp("bench") / "s.json"
    args = ["bench", "structured", "--requests", "6", "--gen-length", "48", "--dtype", "float32", "--out", str(out)]
    args += ["--model", "celeris-block"]
    r = runner.invoke(app, args, terminal_width=200)
    assert r.exit_code == 0, r.output
    return r.stdout, json.loads(out.read_text())


def test_prints_one_row_per_way(report: tuple[str, dict[str, Any]]) -> None:
    table, data = report
    assert [row["way"] for row in data["rows"]] == list(WAYS)
    lines = table.splitlines()
    for way in WAYS:
        assert sum(line.lstrip("│ ").startswith(way) for line in lines) == 1, table
    assert data["requests"] == 6 and data["gen_length"] == 48 and data["dtype"] == "float32"
    assert data["strategy"] == "block-fast"


def test_constrained_answers_that_stop_all_validate(report: tuple[str, dict[str, Any]]) -> None:
    rows = {row["way"]: row for row in report[1]["rows"]}
    for way in ("left-to-right", "template"):
        row = rows[way]
        assert row["stop"] > 0 and row["stop_validates"] == row["stop"], row
        assert row["errors"] == row["length"]  # a constrained answer that ran out names why
    assert rows["unconstrained"]["errors"] == 0


def test_counts_add_up(report: tuple[str, dict[str, Any]]) -> None:
    for row in report[1]["rows"]:
        assert row["answers"] == 6 and row["stop"] + row["length"] == 6
        assert row["stop_validates"] <= row["validates"] <= row["parses"] <= 6
        each = row["by_schema"].values()
        assert sorted(row["by_schema"]) == sorted(SCHEMAS) and all(s["answers"] == 1 for s in each)
        for key in ("parses", "validates", "stop"):
            assert sum(s[key] for s in each) == row[key]
        assert row["nfe_per_answer"] > 0 and row["output_tokens"] > 0


def test_template_row_pins_the_fixed_shapes_that_fit(report: tuple[str, dict[str, Any]]) -> None:
    schemas = report[1]["schemas"]
    # person (42 tokens) and label (19) fit 48; product (59) and address (83) are fixed but longer; event
    # (a pattern) and tags (an array of unknown length) have no fixed shape
    assert {name for name, s in schemas.items() if s["pinned"]} == {"person", "label"}
    assert [row["pinned"] for row in report[1]["rows"]] == [0, 0, 2]
    assert "event, tags" not in report[0] and "product, event, address, tags" in report[0]


def test_a_left_to_right_strategy_decodes_the_template_row_left_to_right(tmp_path: Any) -> None:
    """Self-speculation (`spec`, the default model's left-to-right strategy) holds no template open: its template
    row pins nothing and decodes left to right, and its constrained answers that finish still validate."""
    out = tmp_path / "s.json"
    args = ["bench", "structured", "--requests", "6", "--gen-length", "48", "--dtype", "float32", "--out", str(out)]
    r = runner.invoke(app, [*args, "--set", '{"strategy": "spec"}'], terminal_width=200)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["strategy"] == "spec" and not any(s["pinned"] for s in data["schemas"].values())
    rows = {row["way"]: row for row in data["rows"]}
    assert [row["pinned"] for row in data["rows"]] == [0, 0, 0]
    for way in ("left-to-right", "template"):
        assert rows[way]["stop"] > 0 and rows[way]["stop_validates"] == rows[way]["stop"], rows[way]


def test_a_default_strategy_without_structured_output_is_refused_with_the_way_out() -> None:
    """The default model's diffusion mode (`nemotron`) has no structured output: the bench says so and names
    `--set`, rather than measuring something else."""
    r = runner.invoke(app, ["bench", "structured", "--requests", "2", "--dtype", "float32"], terminal_width=200)
    assert r.exit_code == 2 and "nemotron" in r.output and "--set" in r.output and "Traceback" not in r.output


def test_requests_are_bounded_before_anything_loads() -> None:
    for n in ("0", "10001"):
        r = runner.invoke(app, ["bench", "structured", "--requests", n])
        assert r.exit_code == 2 and "--requests" in r.output and "Traceback" not in r.output


def test_workload_is_deterministic_and_takes_the_schemas_in_turn() -> None:
    assert workload(14) == workload(14)
    assert [name for name, _ in workload(8)] == [*SCHEMAS, "person", "product"]
    assert workload(7)[0][1] == "Extract the person: Ada Lovelace, 36 years old."
    assert workload(7)[6][1] != workload(7)[0][1]  # the next person


def _result(text: str, finish: str = "stop") -> Result:
    return Result(prompt="p", text=text, finish_reason=finish, prompt_tokens=1, output_tokens=3, denoise_steps=1,
                  steps_per_block=[1], nfe=4, wall_s=0.1, tokens_per_s=1.0, batch_size=1, device="cpu",
                  dtype="float32")  # fmt: skip


def test_scoring_counts_parsing_validating_and_finishing_apart() -> None:
    answers = [
        ('{"name":"Ada","age":36}', "stop"),  # valid
        ('{"name":"Ada","age":36 }  ', "stop"),  # valid, a template's blanks
        ('{"name":"Ada","age":151}', "stop"),  # JSON, out of range
        ('{"name":"Ada","age":36,"x":1}', "stop"),  # JSON, a key the schema as given forbids
        ('{"name":"Ada","age":', "length"),  # not JSON
        ("Ada Lovelace", "stop"),  # not JSON
    ]
    score = _score([_result(t, f) for t, f in answers], ["person"] * len(answers), jsonschema)
    assert (score["parses"], score["validates"], score["stop_validates"]) == (4, 2, 2)
    assert (score["stop"], score["length"], score["output_tokens"], score["nfe_per_answer"]) == (5, 1, 18, 4.0)
    assert score["by_schema"] == {"person": {"answers": 6, "parses": 4, "validates": 2, "stop": 5}}
