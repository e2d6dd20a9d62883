"""Nemotron-Labs-Diffusion: one checkpoint, its AR mode (`ar`) and its diffusion mode (`nemotron`).

The reference data (tests/data/nemotron, README and provenance there) were made in a scratch environment with
`transformers`' Ministral-3, the backbone the family's own code wraps: that code imports a Ministral module
found in no reachable repository, so it could not run. The forward (YaRN, Llama-4 query scale, causal,
bidirectional, a block over a causal cache) and the AR mode (greedy `generate`, which is the family's
`ar_generate`) are checked against it token for token. The diffusion mode is the family's `generate` as its
source reads (see `decode.nemotron`); with one-token blocks it must be the AR mode exactly, which ties it to
the reference too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.kv import KVCache
from celeris_cli.arch.nemotron import NemotronModel
from celeris_cli.cli import app
from celeris_cli.errors import UsageError

DATA = Path(__file__).parent / "data" / "nemotron"
FOLDER = DATA / "nemotron_tiny"
REF = json.loads((DATA / "nemotron_reference.json").read_text(encoding="utf-8"))
CASES = REF["ar_generate"]["cases"]
PROMPTS = [list(p) for p in dict.fromkeys(tuple(c["input_ids"]) for c in CASES)]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def test_tensor_names_and_the_forward_equal_transformers_ministral3_in_float32() -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    model = load_model(FOLDER)
    assert isinstance(model, NemotronModel) and saved == set(model.state_dict())
    expected = load_file(str(DATA / "logits.safetensors"))
    ids = expected["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, _causal(40)), expected["logits_causal"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(ids), expected["logits_bidirectional"], atol=1e-4, rtol=1e-4)
        # the prefix written causally into a cache, then one block attending to it and to itself
        _, kv = model.hidden(ids[:, :24], None, _causal(24))
        cache = KVCache.empty(len(kv), 1, kv[0][0].shape[1], 40, kv[0][0].shape[3], torch.float32, ids.device)
        for (ck, cv), (k, v) in zip(cache.layers, kv):
            ck[:, :, :24], cv[:, :, :24] = k, v
        h, _ = model.hidden(ids[:, 24:], None, None, cache.view(0, 40), 24)
        torch.testing.assert_close(model.head(h), expected["logits_block_over_causal_cache"], atol=1e-4, rtol=1e-4)


def test_the_query_scale_and_yarn_act_past_the_original_length() -> None:
    """Both act from position 16 (`original_max_position_embeddings`) on: a model without them differs there only."""
    from dataclasses import replace

    from safetensors.torch import load_file

    model = load_model(FOLDER)
    ids = load_file(str(DATA / "logits.safetensors"))["input_ids"]
    with torch.no_grad():
        full = model(ids, _causal(40))
        model.cfg = replace(model.cfg, yarn=replace(model.cfg.yarn, llama_4_scaling_beta=0.0))
        plain = model(ids, _causal(40))
    assert torch.equal(full[:, :16], plain[:, :16])
    assert (full[:, 16:] - plain[:, 16:]).abs().max() > 1e-3


def test_it_loads_with_its_strategies_self_speculation_first(engine) -> None:  # type: ignore[no-untyped-def]
    assert engine.arch.name == "nemotron_labs_diffusion"
    assert engine.arch.strategies == ("spec", "nemotron", "ar", "nemotron-spec") and engine.params().strategy == "spec"
    assert engine.tokenizer.mask_id == REF["ids"]["mask"] and engine.tokenizer.eos_id == REF["ids"]["eos"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['prompt']}-{c['generate_kwargs']['max_new_tokens']}" for c in CASES])
def test_the_ar_mode_equals_greedy_generate_token_for_token(engine, case) -> None:  # type: ignore[no-untyped-def]
    n = case["generate_kwargs"]["max_new_tokens"]
    params = engine.params({"strategy": "ar", "gen_length": n, "temperature": 0.0})
    [out], nfe = engine.decode_ids([case["input_ids"]], params)
    want = case["generated_ids"]
    assert out[: len(want)] == want
    if len(want) < n:  # it stopped at its eos, and so did we: one forward per token, the prefill among them
        assert want[-1] == REF["ids"]["eos"] and nfe == len(want)


def test_batched_rows_equal_the_reference_and_each_row_alone(engine) -> None:  # type: ignore[no-untyped-def]
    batched = REF["ar_generate"]["batched"]
    n = batched["generate_kwargs"]["max_new_tokens"]
    prompts = [
        [t for t, m in zip(ids, mask) if m] for ids, mask in zip(batched["input_ids"], batched["attention_mask"])
    ]
    for strategy in ("ar", "nemotron"):
        settings = {"strategy": strategy, "gen_length": n, "temperature": 0.0}
        if strategy == "nemotron":
            settings.update(block_length=4, block_steps=3)
        params = engine.params(settings)
        together, _ = engine.decode_ids(prompts, params)
        assert together == [engine.decode_ids([p], params)[0][0] for p in prompts]
        if strategy == "ar":
            for row, want in zip(together, batched["generated_ids"]):
                cut = want.index(2) + 1 if 2 in want else len(want)
                assert row[:cut] == want[:cut]


def test_one_token_blocks_are_the_ar_mode(engine) -> None:  # type: ignore[no-untyped-def]
    """A block of one token is its seed, chosen by the causal pass before it: left-to-right decoding."""
    ar = engine.params({"strategy": "ar", "gen_length": 20, "temperature": 0.0})
    seeded = engine.params({"strategy": "nemotron", "gen_length": 20, "block_length": 1, "temperature": 0.0})
    assert engine.decode_ids(PROMPTS, seeded)[0] == engine.decode_ids(PROMPTS, ar)[0]


def test_longer_blocks_decode_in_fewer_forwards_and_each_setting_counts(engine) -> None:  # type: ignore[no-untyped-def]
    base = {"strategy": "nemotron", "gen_length": 24, "temperature": 0.0}
    runs = {}
    for name, extra in {
        "ar-like": {"block_length": 1},
        "block 8, 7 steps": {"block_length": 8, "block_steps": 7},
        "block 8, 3 steps": {"block_length": 8, "block_steps": 3},
        "block 8, threshold": {"block_length": 8, "block_steps": 7, "threshold": 0.3},
    }.items():
        out, nfe = engine.decode_ids(PROMPTS[:1], engine.params({**base, **extra}))
        runs[name] = (out[0], nfe)
    assert all(t != 2 for t in runs["ar-like"][0][:8])  # the comparison below is over whole blocks
    # a prefill, 3 blocks of 7 steps, 2 commit passes between them
    assert runs["block 8, 7 steps"][1] == 1 + 3 * 7 + 2
    assert runs["block 8, 3 steps"][1] == 1 + 3 * 3 + 2
    assert runs["block 8, 3 steps"][0] != runs["block 8, 7 steps"][0]
    assert runs["block 8, threshold"][1] < runs["block 8, 7 steps"][1]
    assert runs["block 8, 7 steps"][0][0] == runs["ar-like"][0][0]  # the first block's seed is the AR token


def test_the_ar_mode_refuses_block_settings_by_name(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="block_length: not used by the ar strategy"):
        engine.params({"strategy": "ar", "block_length": 4})
    with pytest.raises(UsageError, match="strategy 'block-fast' does not run"):
        engine.decode_ids(PROMPTS[:1], engine.params({"strategy": "block-fast", "gen_length": 8}))


def test_sampling_depends_on_the_seed_alone(engine) -> None:  # type: ignore[no-untyped-def]
    for strategy in ("ar", "nemotron"):
        settings = {"strategy": strategy, "gen_length": 16, "temperature": 1.0}
        if strategy == "nemotron":
            settings["block_length"] = 4
        params = engine.params(settings)
        a, _ = engine.decode_ids(PROMPTS, params, seeds=[1, 2, 3, 4])
        b, _ = engine.decode_ids(PROMPTS[2:3], params, seeds=[3])
        c, _ = engine.decode_ids(PROMPTS[2:3], params, seeds=[5])
        assert a[2] == b[0] and b[0] != c[0]


def test_generate_runs_it_as_saved_by_default_and_in_its_ar_mode() -> None:
    for extra in ([], ["--strategy", "ar"]):
        result = CliRunner().invoke(
            app, ["generate", "--model", str(FOLDER), "--prompt", "hello", "--gen-length", "16", *extra, "--json"]
        )
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        assert record["output_tokens"] > 0 and record["settings"]["strategy"] == (extra[-1] if extra else "spec")


def test_each_blocks_seed_is_the_ar_next_token_after_the_text_so_far(engine) -> None:  # type: ignore[no-untyped-def]
    """The commit pass writes a block's keys and values causally, exactly as a causal prefill of the same
    text would, so the next block's seed is the AR mode's next token after everything decoded so far."""
    W, G = 3, 24
    seeded = engine.params({"strategy": "nemotron", "gen_length": G, "block_length": W, "temperature": 0.0})
    one = engine.params({"strategy": "ar", "gen_length": 1, "temperature": 0.0})
    for prompt in PROMPTS:
        [answer], _ = engine.decode_ids([prompt], seeded)
        for j in range(1, G // W):
            if 2 in answer[: j * W]:
                break  # the row stopped: no more seeds
            [[nxt]], _ = engine.decode_ids([prompt + answer[: j * W]], one)
            assert answer[j * W] == nxt


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_medium": 2}}, "keys \\['beta_medium'\\]"),
        ({"dlm_paradigm": "autoregressive"}, "dlm_paradigm 'autoregressive' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mask_token_id": 4000}, "mask_token_id 4000 is outside the embedding table"),
    ],
)
def test_a_config_it_does_not_follow_is_refused_by_name(tmp_path: Path, change: dict, message: str) -> None:  # type: ignore[type-arg]
    import shutil

    from celeris_cli.errors import ModelError

    folder = tmp_path / "m"
    shutil.copytree(FOLDER, folder)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    raw.pop("rope_scaling")
    (folder / "config.json").write_text(json.dumps({**raw, **change}), encoding="utf-8")
    with pytest.raises(ModelError, match=message):
        load_engine(folder, device="cpu", dtype="float32")
    result = CliRunner().invoke(app, ["generate", "--model", str(folder), "--prompt", "hello"])
    assert result.exit_code != 0 and "Traceback" not in result.output
