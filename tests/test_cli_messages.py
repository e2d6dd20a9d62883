"""Small things the command line says: each message and help line reads as written for a person, with no
library's wording leaking through and nothing said twice."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app
from celeris_cli.cli.defaults import knob_help
from celeris_cli.params import KNOBS

runner = CliRunner()
FAST = ["--gen-length", "8", "--block-length", "8", "--denoise-steps", "4", "--device", "cpu"]


@pytest.mark.parametrize(
    "args",
    [["generate", "--quantize", "int3"], ["inspect", "--quantize", "int3"], ["generate", "--device", "gpu"]],
)
def test_a_bad_choice_is_named_without_pydantics_words(args: list[str]) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 2
    assert re.search(r"Invalid value for '--\w+': '(int3|gpu)' is not one of '", r.output), r.output
    assert "Value error" not in r.output


def test_knob_help_names_its_strategies_once() -> None:
    for name, knob in KNOBS.items():
        text = knob_help(name, knob.help)
        lead = re.match(r"([\w, -]+): ", text)
        assert not (lead and text[lead.end() :].startswith(lead.group(0))), text
    assert knob_help("draft_threshold", KNOBS["draft_threshold"].help).startswith("nemotron-spec: each draft")
    assert knob_help("greedy", KNOBS["greedy"].help).startswith("rnd1: take each")


def test_a_required_argument_is_shown_plainly_on_the_usage_line() -> None:
    for command, usage in (("retry", "retry [OPTIONS] LOG"), ("watch", "[OPTIONS] CONFIG")):
        r = runner.invoke(app, [command, "--help"], prog_name="celeris")
        first = r.output.splitlines()[0]
        assert usage in first and "{" not in first, first


def test_inspect_names_what_the_config_declares_and_the_weights_format() -> None:
    r = runner.invoke(app, ["inspect"])
    assert r.exit_code == 0, r.output
    assert re.search(r"architecture\s+llada_spec \(model_type 'llada'\)$", r.output, re.M), r.output
    r = runner.invoke(app, ["inspect", "--memory", "--dtype", "float32"])
    assert "float32, weights not quantized:" in r.output and "weights none" not in r.output, r.output
    r = runner.invoke(app, ["inspect", "--memory", "--dtype", "float32", "--quantize", "int8"])
    assert "float32, int8 weights:" in r.output, r.output


def test_one_prompt_reports_a_batch_of_one(tiny_model: Path) -> None:
    r = runner.invoke(app, ["generate", "--model", str(tiny_model), "--prompt", "床前明月光，", "--json", *FAST])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["batch_size"] == 1


def test_retry_without_a_config_here_says_how_to_name_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "failed.jsonl").write_text("{}\n")
    r = runner.invoke(app, ["retry", "failed.jsonl"])
    assert r.exit_code == 2
    assert "configs/batch.yaml: config file not found" in r.output and "-c/--config" in r.output, r.output
