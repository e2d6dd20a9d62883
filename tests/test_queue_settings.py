"""Settings through the queue: a request's answer depends only on the request (not on the file it came
in or its neighbours), OpenAI sampling keys are honoured or rejected by name, and a user's mistake is a
non-retryable `bad_param` classified by the error's type."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from celeris_cli.spool.formats import parse_file

from .spool_helpers import drop, failures, make_queue, outputs

REPO = Path(__file__).parents[1]


def watch_once(config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "celeris_cli", "watch", str(config), "--once"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def line(custom_id: str, prompt: str, **body: object) -> str:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}
    )


def test_the_same_request_in_two_files_with_different_neighbours_gives_the_same_text(
    tmp_path: Path, tiny_model: Path
) -> None:
    sampled = {"temperature": 1.2, "seed": 77, "max_tokens": 16}
    same = line("same", "床前明月光，", **sampled)
    a = [line(f"a{i}", p, temperature=1.2, seed=i, max_tokens=16) for i, p in enumerate(["春", "The quick brown fox"])]
    b = [
        line(f"b{i}", p, temperature=1.2, seed=9 + i, max_tokens=16)
        for i, p in enumerate(["白日依山尽，黄河入海流。", "To"])
    ]
    config = make_queue(tmp_path, model=tiny_model, batch_size=8, generation={"denoise_steps": 16})
    drop(tmp_path, "first.jsonl", "\n".join([a[0], same, a[1]]) + "\n")
    assert watch_once(config).returncode == 0
    drop(tmp_path, "second.jsonl", "\n".join([*b, same]) + "\n")  # a later run: other batch mates
    p = watch_once(config)
    assert p.returncode == 0, p.stderr
    out = outputs(tmp_path)
    first = {r["custom_id"]: r["response"]["body"] for r in out["first.jsonl.results.jsonl"]}
    second = {r["custom_id"]: r["response"]["body"] for r in out["second.jsonl.results.jsonl"]}
    assert first["same"]["text"] == second["same"]["text"]
    assert first["same"]["settings"]["seed"] == 77
    # requests with different seeds and batch mates decoded together, the three of each file in one running
    # set (batch_size: its width, or the rows that came when fewer), so the equality is not trivial
    assert first["same"]["timing"]["batch_size"] == second["same"]["timing"]["batch_size"] == 3
    assert first["a0"]["text"] != first["same"]["text"]


def test_openai_sampling_keys_are_honoured_and_unsupported_ones_named(tmp_path: Path, tiny_model: Path) -> None:
    rows = [
        line("topk", "床前明月光，", temperature=1.0, top_k=1, top_p=0.5, max_completion_tokens=12, user="u1"),
        line("greedy", "床前明月光，", temperature=0, max_tokens=12, metadata={"k": "v"}, stop=None),
        line("n2", "x", n=2),
        line("lp", "x", logprobs=True, top_logprobs=2, max_tokens=12),
        line("lp_legacy", "x", logprobs=3, max_tokens=12),  # the completions endpoint's integer form
        line("lp_big", "x", logprobs=9),  # the integer form lists at most 5
        # the values OpenAI's clients send by default ask for nothing: a strategy without log probabilities
        # or constraints takes them
        line("neutral", "x", strategy="reference", logprobs=False, top_logprobs=0, response_format={"type": "text"}),
        line("stream", "x", stream=True),
        line("big_seed", "x", seed=2**64),
        line("ctx", "x", context_len=3),
    ]
    config = make_queue(tmp_path, model=tiny_model, generation={"denoise_steps": 12, "block_length": 12})
    drop(tmp_path, "oa.jsonl", "\n".join(rows) + "\n")
    p = watch_once(config)
    assert p.returncode == 1, p.stderr
    got = {r["custom_id"]: r["response"]["body"] for r in outputs(tmp_path)["oa.jsonl.results.jsonl"]}
    assert set(got) == {"topk", "greedy", "lp", "lp_legacy", "neutral"}
    for key, top in (("lp", 2), ("lp_legacy", 3)):
        entries = got[key]["logprobs"]["content"]
        assert len(entries) == got[key]["usage"]["completion_tokens"] > 0
        assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == top for e in entries)
    assert "logprobs" not in got["topk"]
    s = got["topk"]["settings"]
    assert (s["top_k"], s["top_p"], s["gen_length"]) == (1, 0.5, 12)
    assert got["topk"]["text"] == got["greedy"]["text"]  # top-k 1 samples the argmax: greedy's answer
    fails = {f["custom_id"]: f for f in failures(tmp_path)}
    assert set(fails) == {"n2", "lp_big", "stream", "big_seed", "ctx"}
    assert all(f["code"] == "bad_param" and f["retryable"] is False for f in fails.values())
    assert "n=2" in fails["n2"]["message"] and "seed" in fails["big_seed"]["message"]
    assert "context_len" in fails["ctx"]["message"]  # an unknown key, not a prompt that is too long


def test_a_stop_string_in_a_request_cuts_its_answer(tmp_path: Path, tiny_model: Path) -> None:
    config = make_queue(tmp_path, model=tiny_model, generation={"denoise_steps": 12, "block_length": 12})
    drop(tmp_path, "free.jsonl", line("q", "床前明月光，", temperature=0, max_tokens=12) + "\n")
    assert watch_once(config).returncode == 0
    free = outputs(tmp_path)["free.jsonl.results.jsonl"][0]["response"]["body"]["text"]
    stop = free[2:4]
    drop(tmp_path, "cut.jsonl", line("q", "床前明月光，", temperature=0, max_tokens=12, stop=[stop]) + "\n")
    assert watch_once(config).returncode == 0
    cut = outputs(tmp_path)["cut.jsonl.results.jsonl"][0]["response"]["body"]
    assert cut["text"] == free[: free.find(stop)] and cut["finish_reason"] == "stop"


def test_unsupported_openai_values_are_line_errors_and_their_neutral_values_pass() -> None:
    rows = [line("a", "x", n=1, logprobs=False, stream=False), line("b", "x", n=3), line("c", "x", n=True)]
    requests, errors = parse_file("f.jsonl", ("\n".join(rows) + "\n").encode(), 10_000)
    assert [r.custom_id for r in requests] == ["a"] and requests[0].params == {}  # logprobs false asks for nothing
    assert [(e.custom_id, e.code) for e in errors] == [("b", "bad_param"), ("c", "bad_param")]


def test_generation_settings_in_batch_yaml_are_checked_when_the_config_loads(tmp_path: Path) -> None:
    from celeris_cli.errors import ConfigError
    from celeris_cli.spool.config import load_config

    for bad, named in (({"temperature": "hot"}, "temperature"), ({"stepz": 3}, "stepz"), ({"seed": -1}, "seed")):
        with pytest.raises(ConfigError, match=f"^generation: .*{named}"):
            load_config(make_queue(tmp_path, generation=bad))
    assert load_config(make_queue(tmp_path, generation={"denoise_steps": 100})).generation == {"denoise_steps": 100}


def test_batch_yaml_names_an_embedded_model_by_its_name_unless_a_folder_of_that_name_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celeris_cli.engine import embedded_models, model_dir
    from celeris_cli.spool.config import load_config

    embedded = embedded_models()["celeris-tiny"].resolve()
    config = make_queue(tmp_path, model="celeris-tiny")  # type: ignore[arg-type]
    cfg = load_config(config)
    assert cfg.model is not None and model_dir(cfg.model) == embedded
    elsewhere = tmp_path / "cwd"
    (elsewhere / "celeris-tiny").mkdir(parents=True)  # one in the daemon's working directory is not taken
    monkeypatch.chdir(elsewhere)
    assert model_dir(cfg.model) == embedded
    (tmp_path / "configs" / "celeris-tiny").mkdir()  # beside the config is not under root either
    assert model_dir(load_config(config).model) == embedded  # type: ignore[arg-type]
    (tmp_path / "celeris-tiny").mkdir()  # a folder under root wins, as any relative path
    assert load_config(config).model == str(tmp_path / "celeris-tiny")
