"""Nemotron-Labs-Diffusion's linear speculative decoding (`nemotron-spec`): diffusion drafts a block, a causal
pass verifies it, the agreeing prefix and one more token are kept. The verifier is the AR mode, so the answer
must be the AR mode's token for token (greedy speculative decoding is lossless; here sampling too, each
accepted token drawing from the stream the AR mode draws it from), alone and in a left-padded batch. The
tiny checkpoint's drafts rarely agree with its AR mode, so a perfect draft (the AR answer itself, put in at
the draft's boundary) shows that several tokens per verify pass are accepted and leave the cache exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.cli import app
from celeris_cli.decode import speculative
from celeris_cli.errors import UsageError

DATA = Path(__file__).parent / "data" / "nemotron"
FOLDER = DATA / "nemotron_tiny"
REF = json.loads((DATA / "nemotron_reference.json").read_text(encoding="utf-8"))
PROMPTS = [list(p) for p in dict.fromkeys(tuple(c["input_ids"]) for c in REF["ar_generate"]["cases"])]
EOS = REF["ids"]["eos"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def _ar(engine: Any, n: int, temperature: float = 0.0) -> Any:
    return engine.params({"strategy": "ar", "gen_length": n, "temperature": temperature})


def _spec(engine: Any, n: int, **extra: Any) -> Any:
    return engine.params({"strategy": "nemotron-spec", "gen_length": n, "temperature": 0.0, **extra})


@pytest.mark.parametrize(
    "extra",
    [{"block_length": 1}, {"block_length": 4}, {"block_length": 8, "draft_threshold": 0.5}, {}],
    ids=["1", "4", "8-threshold", "32"],
)
def test_greedy_speculation_is_the_ar_mode_token_for_token_alone_and_batched(engine, extra) -> None:  # type: ignore[no-untyped-def]
    n = 40
    ar, _ = engine.decode_ids(PROMPTS, _ar(engine, n))
    spec = _spec(engine, n, **extra)
    together, _ = engine.decode_ids(PROMPTS, spec)
    assert len({len(p) for p in PROMPTS}) > 1  # left padding is exercised
    assert together == ar
    assert [engine.decode_ids([p], spec)[0][0] for p in PROMPTS] == ar


def test_sampled_speculation_draws_the_ar_modes_tokens_from_the_same_streams(engine) -> None:  # type: ignore[no-untyped-def]
    seeds = [3, 4, 5, 6]
    ar, _ = engine.decode_ids(PROMPTS, _ar(engine, 32, temperature=1.0), seeds=seeds)
    spec = _spec(engine, 32, temperature=1.0, block_length=6)
    together, _ = engine.decode_ids(PROMPTS, spec, seeds=seeds)
    assert together == ar
    assert engine.decode_ids(PROMPTS[1:2], spec, seeds=[4])[0][0] == ar[1]
    assert engine.decode_ids(PROMPTS[1:2], spec, seeds=[9])[0][0] != ar[1]


def _oracle(answers: dict[int, list[int]], wrong_at: int | None) -> Any:
    """A draft that is the AR answer (row -> its answer ids), wrong at block column `wrong_at` if given."""

    def draft(rows, block, plan, mask_id, noise, answer_at):  # type: ignore[no-untyped-def]
        W = block.shape[1]
        for b, (r, t) in enumerate(zip(rows.idx.tolist(), answer_at)):
            want = (answers[r] + [EOS] * W)[t : t + W]
            block[b] = torch.tensor(want)
            if wrong_at is not None:
                block[b, wrong_at] = (want[wrong_at] + 1) % 100 + 200
        return block

    return draft


@pytest.mark.parametrize(("wrong_at", "per_verify"), [(None, 5), (2, 2)], ids=["perfect", "wrong-third"])
def test_a_verify_pass_accepts_the_agreeing_draft_and_one_token_more(engine, monkeypatch, wrong_at, per_verify) -> None:  # type: ignore[no-untyped-def]
    """With block 5, a perfect draft gives 5 tokens a verify pass (4 confirmed and the bonus); one wrong at
    the third column, 2 (the second confirmed, then the verifier's own third). The text after each pass
    is decoded on from the cache the pass left, so the answer equals the AR mode's only if that cache holds
    exactly the committed tokens' keys and values."""
    n, prompts = 21, [PROMPTS[0], PROMPTS[2]]  # the first token, then 20 in whole passes
    ar, _ = engine.decode_ids(prompts, _ar(engine, n))
    assert all(EOS not in row for row in ar) and len(prompts[0]) != len(prompts[1])  # to the end, left-padded
    monkeypatch.setattr(speculative, "_draft", _oracle(dict(enumerate(ar)), wrong_at))
    together, forwards = engine.decode_ids(prompts, _spec(engine, n, block_length=5))
    assert together == ar
    assert forwards == 1 + (n - 1) // per_verify  # the prefill, then the verify passes alone


def test_the_draft_threshold_changes_the_forwards_not_the_answer(engine) -> None:  # type: ignore[no-untyped-def]
    runs = {t: engine.decode_ids(PROMPTS[:1], _spec(engine, 24, block_length=8, draft_threshold=t)) for t in (0, 0.9)}
    assert runs[0][0] == runs[0.9][0]
    assert runs[0.9][1] > runs[0][1]  # a surer draft takes more forwards


def test_settings_it_does_not_honour_are_refused_by_name(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="block_steps: not used by the nemotron-spec strategy"):
        engine.params({"strategy": "nemotron-spec", "block_steps": 4})
    with pytest.raises(UsageError, match="draft_threshold: not used by the nemotron strategy"):
        engine.params({"strategy": "nemotron", "draft_threshold": 0.5})
    for args, message in [
        (["--model", str(FOLDER), "--strategy", "nemotron-spec", "--remasking", "random"], "--remasking: not used"),
        (["--model", str(FOLDER), "--draft-threshold", "0.5"], "--draft-threshold: not used by the spec strategy"),
        (["--strategy", "nemotron-spec"], "nemotron-spec"),  # the default model has no AR mode
    ]:
        result = CliRunner().invoke(app, ["generate", "--prompt", "hi", *args])
        assert result.exit_code != 0 and "Traceback" not in result.output, result.output
        assert message in result.output


def test_generate_runs_it_from_the_command_line() -> None:
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(FOLDER), "--prompt", "hello", "--gen-length", "16", "--strategy", "nemotron-spec"]
        + ["--block-length", "4", "--json"],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["settings"]["strategy"] == "nemotron-spec" and record["settings"]["draft_threshold"] == 0.0
    assert record["output_tokens"] > 0


def test_bench_runs_its_modes_side_by_side_the_ar_mode_first(engine) -> None:  # type: ignore[no-untyped-def]
    from celeris_cli.measure.bench import bench

    report = bench(engine, n_prompts=2, batch_size=2, gen_length=8, block_length=4, cache_agreement=False)
    modes = report["modes"]
    assert list(modes) == ["ar", "nemotron", "nemotron-spec", "spec"] and modes["ar"]["speedup"] == 1.0
    for spec in ("nemotron-spec", "spec"):
        assert modes[spec]["output_tokens"] == modes["ar"]["output_tokens"]  # greedy: the same answers
        assert modes[spec]["distinct_2"] == modes["ar"]["distinct_2"]
    assert report["default_mode"] == "spec"
