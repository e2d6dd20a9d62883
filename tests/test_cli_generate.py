from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app

from .conftest import make_model

runner = CliRunner()
FAST = ["--gen-length", "8", "--block-length", "8", "--denoise-steps", "4", "--device", "cpu"]


def run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["generate", *args])


def test_generate_prints_text_and_json_record(tiny_model: Path) -> None:
    r = run("--model", str(tiny_model), "--prompt", "床前明月光，", *FAST)
    assert r.exit_code == 0, r.output
    r = run("--model", str(tiny_model), "--prompt", "床前明月光，", "--json", *FAST)
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    for key in (
        "text",
        "prompt_tokens",
        "output_tokens",
        "denoise_steps",
        "nfe",
        "wall_s",
        "tokens_per_s",
        "device",
        "dtype",
    ):
        assert key in rec
    assert rec["denoise_steps"] == 4 and rec["nfe"] == 4


def test_jsonl_and_file_input_give_one_record_per_prompt(tiny_model: Path, tmp_path: Path) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("\ufeff床前\r\n\r\nTo be\r\n", encoding="utf-8")
    r = run("--model", str(tiny_model), "--file", str(f), "--prompt", "春", "--jsonl", *FAST)
    assert r.exit_code == 0, r.output
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["prompt"] for x in recs] == ["春", "床前", "To be"]


def test_help_does_not_import_torch() -> None:
    code = "import sys; from celeris_cli.cli import app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _error(result) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    return result.output


def test_missing_model_folder(tmp_path: Path) -> None:
    out = _error(run("--model", str(tmp_path / "nope"), "--prompt", "x", *FAST))
    assert "Error: model folder not found" in out


def test_a_bare_name_that_is_no_folder_names_the_embedded_models() -> None:
    out = _error(run("--model", "celeris-huge", "--prompt", "x", *FAST))
    assert "'celeris-huge'" in out and all(n in out for n in ("celeris-block", "celeris-spec", "celeris-tiny"))


def test_incomplete_model_folder(tmp_path: Path, tiny_model: Path) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    (folder / "model.safetensors").unlink()
    assert "is incomplete" in _error(run("--model", str(folder), "--prompt", "x", *FAST))
    (tmp_path / "empty").mkdir()
    assert "config.json is missing" in _error(run("--model", str(tmp_path / "empty"), "--prompt", "x", *FAST))


def test_tokenizer_mismatch(tmp_path: Path, tiny_tokenizer: Path) -> None:
    folder = make_model(tmp_path / "m", tiny_tokenizer, vocab_size=100, embedding_size=100)
    out = _error(run("--model", str(folder), "--prompt", "x", *FAST))
    assert "does not belong to this model" in out


def test_prompt_longer_than_context(tiny_model: Path) -> None:
    out = _error(run("--model", str(tiny_model), "--prompt", "床" * 400, *FAST))
    assert "exceeds the model's context" in out


@pytest.mark.parametrize("opt", ["--denoise-steps", "--gen-length", "--block-length", "--batch-size"])
def test_non_positive_counts(tiny_model: Path, opt: str) -> None:
    out = _error(run("--model", str(tiny_model), "--prompt", "x", opt, "0"))
    assert opt in out


@pytest.mark.parametrize(
    "args", [["--remasking", "sideways"], ["--dtype", "float8"], ["--device", "tpu"], ["--strategy", "warp"]]
)
def test_unknown_option_values(tiny_model: Path, args: list[str]) -> None:
    out = _error(run("--model", str(tiny_model), "--prompt", "x", *FAST[:-2], *args))
    assert args[1] in out


def test_cuda_requested_without_cuda(tiny_model: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = _error(run("--model", str(tiny_model), "--prompt", "x", "--device", "cuda"))
    assert "CUDA is not available" in out


def test_no_prompt_is_a_clear_error(tiny_model: Path) -> None:
    assert "no prompt given" in _error(run("--model", str(tiny_model)))


def test_errors_reach_stderr_of_a_real_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    p = subprocess.run(
        [sys.executable, "-m", "celeris_cli", "generate", "--model", str(tmp_path), "--prompt", "x"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.startswith("Error: ") and "Traceback" not in p.stderr


def test_fast_options_reach_the_settings(tiny_model: Path) -> None:
    r = run(
        "--model",
        str(tiny_model),
        "--prompt",
        "x",
        "--json",
        "--threshold",
        "0.5",
        "--cache",
        "prefix",
        "--confidence",
        "lead",
        "--no-early-exit",
        "--strategy",
        "fast",
        "--min-p",
        "0.05",
        "--order-temperature",
        "1.5",
        *FAST,
    )
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["settings"]
    assert (s["threshold"], s["cache"], s["confidence"], s["early_exit"]) == (0.5, "prefix", "lead", False)
    assert (s["min_p"], s["order_temperature"]) == (0.05, 1.5)


def test_negative_order_temperature_is_a_clear_error(tiny_model: Path) -> None:
    out = _error(run("--model", str(tiny_model), "--prompt", "x", "--order-temperature", "-1"))
    assert "--order-temperature must be a finite number >= 0, got -1.0" in out


@pytest.mark.parametrize("value", ["1", "-0.1"])
def test_min_p_out_of_range_is_a_clear_error(tiny_model: Path, value: str) -> None:
    out = _error(run("--model", str(tiny_model), "--prompt", "x", "--min-p", value))
    assert "--min-p must be in [0, 1)" in out


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--denoise-steps", "100000"], "--denoise-steps 100000 exceeds gen_length"),
        (["--steps", "100000"], "--denoise-steps 100000 exceeds"),
        (["--gen-length", "100000000"], "--gen-length must be a positive integer, at most 1048576"),
        (["--temperature", "inf"], "--temperature must be"),
        (["-t", "-1"], "--temperature must be"),
        (["--seed", "18446744073709551616"], "--seed must be"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top-k", "2.5"], "--top-k must be an integer, got '2.5'"),
        (["--cache", "sideways"], "--cache: unknown value 'sideways' (choose dual, prefix, none)"),
        (["--strategy", "reference", "--threshold", "0.5"], "--threshold: not used by the reference strategy"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_setting(tiny_model: Path, args: list[str], named: str) -> None:
    r = run("--model", str(tiny_model), "--prompt", "x", *args)
    assert r.exit_code == 2 and "Traceback" not in r.output
    [line] = r.output.strip().splitlines()
    assert line.startswith("Error: ") and named in line


@pytest.mark.parametrize(("key", "value"), [("n_layers", 6.0), ("max_sequence_length", "512"), ("n_layers", "6")])
def test_mistyped_config_json_exits_2_naming_the_key(
    tmp_path: Path, tiny_tokenizer: Path, key: str, value: object
) -> None:
    folder = make_model(tmp_path / "m", tiny_tokenizer)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, key: value}))
    r = run("--model", str(folder), "--prompt", "x", *FAST)
    assert r.exit_code == 2 and "Traceback" not in r.output and f"config.json: {key} must be" in r.output


def test_cfg_and_random_remasking_change_the_default_strategys_text(tiny_model: Path) -> None:
    def texts(*extra: str) -> list[str]:
        r = run("--model", str(tiny_model), "-p", "床前明月光，", "-p", "To be", "--jsonl", "-t", "0", *FAST, *extra)
        assert r.exit_code == 0, r.output
        return [json.loads(line)["text"] for line in r.stdout.splitlines()]

    plain = texts()
    assert texts("--cfg-scale", "2") != plain
    assert texts("--remasking", "random") != plain


def test_samples_use_consecutive_seeds_and_match_single_runs(tiny_model: Path) -> None:
    args = ["--model", str(tiny_model), "-p", "床前", "--jsonl", "-t", "1.0", *FAST]
    r = run(*args, "--samples", "3", "--seed", "40")
    assert r.exit_code == 0, r.output
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["seed"] for x in recs] == [40, 41, 42]
    single = json.loads(run(*args, "--seed", "41").stdout)
    assert single["text"] == recs[1]["text"] and single["settings"]["seed"] == 41


def test_the_summary_counts_prompts_and_answers_apart(tiny_model: Path) -> None:
    r = run("--model", str(tiny_model), "-p", "床前", "--samples", "3", *FAST)
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith("[1 prompt(s), 3 answers, "), r.stderr
    r = run("--model", str(tiny_model), "-p", "床前", "-p", "白日", *FAST)
    assert r.stderr.startswith("[2 prompt(s), "), r.stderr
    assert "answers" not in r.stderr  # one answer a prompt: the prompt count says it


def test_json_reports_the_steps_that_ran(tiny_model: Path) -> None:
    r = run(
        "--model", str(tiny_model), "-p", "x", "--json", "--gen-length", "64", "--block-length", "4",
        "--denoise-steps", "3", "--no-early-exit", "--device", "cpu",
    )  # fmt: skip
    rec = json.loads(r.stdout)
    assert rec["steps_per_block"] == [1] * 16 and rec["denoise_steps"] == 16
    assert rec["settings"]["strategy"] == "fast" and rec["nfe"] <= 16


def test_every_flag_of_the_fast_strategy_lands_in_the_settings_that_ran(tiny_model: Path) -> None:
    """Each knob's command-line flag reaches the decoder: the answer's settings carry the value given (a flag
    left out of the overrides would show the model's default instead)."""
    from celeris_cli.params import PER_REQUEST, honoured

    given: dict[str, object] = {
        "gen_length": 12, "block_length": 4, "denoise_steps": 6, "temperature": 0.7, "min_p": 0.05,
        "top_p": 0.9, "top_k": 5, "remasking": "low_confidence", "order_temperature": 0.5, "cfg_scale": 0.5,
        "threshold": 0.8, "cache": "prefix", "confidence": "margin", "early_exit": False, "suffix_window": 4,
        "presence_penalty": 0.3, "min_tokens": 2, "subword_min_p": 0.4,
        "structured_outputs": '{"regex":"[a-z ]+"}', "logprobs": True, "top_logprobs": 2,
        "structured_layout": "left-to-right",
    }  # fmt: skip
    assert set(given) == set(honoured("fast")) - set(PER_REQUEST)  # a new knob must be added here
    flags = [f"--{k.replace('_', '-')}" if v is not False else f"--no-{k.replace('_', '-')}" for k, v in given.items()]
    args = [a for f, v in zip(flags, given.values()) for a in ([f] if isinstance(v, bool) else [f, str(v)])]
    r = run("--model", str(tiny_model), "--prompt", "To be", "--json", "--device", "cpu", "--seed", "7", *args)
    assert r.exit_code == 0, r.output
    settings = json.loads(r.stdout)["settings"]
    assert {k: settings[k] for k in given} == given and settings["seed"] == 7
