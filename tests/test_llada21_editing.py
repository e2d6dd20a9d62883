"""LLaDA2.1's token editing (`--edit-threshold`, `--max-post-edit-steps`, the `block` strategy) against greedy
outputs of LLaDA2.1's own `generate` on the tiny LLaDA2 checkpoint (tests/data/llada21: provenance and the
algorithm as its source reads, made in a scratch environment outside this project)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celeris_cli import load_engine
from celeris_cli.decode.strategies import SpecialTokens
from celeris_cli.errors import UsageError

from .conftest import family_head, predicting_the_mask

DATA = Path(__file__).parent / "data"
REF = json.loads((DATA / "llada21" / "llada21_reference.json").read_text(encoding="utf-8"))
CASES = REF["generate"]["cases"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return family_head(load_engine(DATA / "llada2" / "llada2_tiny", device="cpu", dtype="float32"))  # as its code


def _settings(kw: dict, strategy: str = "block") -> dict:  # type: ignore[type-arg]
    """Its generate's arguments as Celeris's settings: num_to_transfer 1 a step is a block's length in
    steps; its `steps` is never used by its code."""
    return {
        "strategy": strategy,
        "temperature": 0.0,
        "gen_length": kw["gen_length"],
        "block_length": kw["block_length"],
        "block_steps": kw["block_length"],
        "threshold": kw["threshold"],
        "edit_threshold": kw["editing_threshold"],
        "max_post_edit_steps": kw["max_post_steps"],
    }


@pytest.mark.parametrize("strategy", ["block", "block-fast"])  # both in the running set; block-fast with a cache
@pytest.mark.parametrize("case", CASES, ids=[f"{c['prompt']}-{c['setting']}" for c in CASES])
def test_greedy_editing_equals_its_own_generate(engine, case, strategy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    eos = REF["ids"]["eos"]  # its generate stops at eos alone (not at <|role_end|>, which this model emits)
    monkeypatch.setattr(engine, "special", SpecialTokens(engine.tokenizer.mask_id, frozenset({eos}), 0))
    params = engine.params(_settings(case["generate_kwargs"], strategy))
    assert engine.continuous(params)
    [out], _ = engine.decode_ids([case["input_ids"]], params)
    got = out[: out.index(eos) + 1] if eos in out else out
    assert got == case["generated_ids"]


def test_editing_edits_and_batched_rows_equal_alone(engine) -> None:  # type: ignore[no-untyped-def]
    edited = [c for c in CASES if c["edits"] > 0]
    assert edited, "the reference data exercise editing"
    kw = edited[0]["generate_kwargs"]
    params = engine.params(_settings(kw))
    prompts = [c["input_ids"] for c in CASES if c["generate_kwargs"] == kw]
    together, _ = engine.decode_ids(prompts, params)
    assert together == [engine.decode_ids([p], params)[0][0] for p in prompts]
    off, _ = engine.decode_ids(prompts, params.with_(edit_threshold=1.0, max_post_edit_steps=0))
    assert off != together  # the setting changes answers where the model is surer of another token


def test_the_cached_strategy_refuses_editing_with_guidance_by_name(engine) -> None:  # type: ignore[no-untyped-def]
    engine.params({"strategy": "block-fast", "edit_threshold": 0.5})  # the running set edits
    with pytest.raises(UsageError, match="edit_threshold with cfg_scale: the block-fast strategy"):
        engine.params({"strategy": "block-fast", "edit_threshold": 0.5, "cfg_scale": 1.0})


def test_the_running_set_edits_rows_joining_mid_run_as_alone(engine) -> None:  # type: ignore[no-untyped-def]
    """Rows with and without editing, of several lengths, through one running set of two rows: each as
    the block strategy gives it alone (where the reference above pins it)."""
    edited = [c for c in CASES if c["edits"] > 0]
    kw = edited[0]["generate_kwargs"]
    prompts = [c["input_ids"] for c in CASES][:6]
    rows = []
    for i, ids in enumerate(prompts):
        settings = _settings(kw, "block-fast") | {"gen_length": kw["gen_length"] + 8 * (i % 3)}
        if i % 2:
            settings |= {"edit_threshold": 1.0, "max_post_edit_steps": 0}
        rows.append((ids, engine.params(settings)))
    texts = [engine.tokenizer.continuation(ids, []) for ids, _ in rows]  # any text: prompts are given as ids
    results = engine.decode_running(texts, [ids for ids, _ in rows], [p for _, p in rows], [0] * len(rows), 2)
    alone = [engine.finish(engine.decode_ids([ids], p.with_(strategy="block"))[0][0], prompt=ids)[0] for ids, p in rows]
    assert [r.text for r in results] == alone


@pytest.mark.parametrize("strategy", ["block", "block-fast"])
def test_editing_ends_a_block_whose_model_predicts_the_mask_itself(engine, strategy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Committing the mask token commits nothing, and past its steps a block commits one mask a step: it
    would never fill. The block ends W steps after its schedule and post-edit steps instead of looping."""
    mask, calls = engine.tokenizer.mask_id, [0]
    monkeypatch.setattr(engine.model, "step_head", predicting_the_mask(engine.model, mask, 2000, calls))
    kw = {"gen_length": 8, "block_length": 4, "threshold": 0.9, "editing_threshold": 0.5, "max_post_steps": 2}
    [out], _ = engine.decode_ids([CASES[0]["input_ids"]], engine.params(_settings(kw, strategy)))
    assert out[:8] == [mask] * 8


def test_editing_settings_in_a_folders_generation_config_are_its_defaults(tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "llada21"
    shutil.copytree(DATA / "llada2" / "llada2_tiny", folder)
    gen = {"editing_threshold": 0.5, "max_post_steps": 16, "threshold": 0.7}  # LLaDA2.1's generate's names
    (folder / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    engine = load_engine(folder, device="cpu", dtype="float32")
    params = engine.params()
    assert (params.edit_threshold, params.max_post_edit_steps, params.threshold) == (0.5, 16, 0.7)
    plain = load_engine(DATA / "llada2" / "llada2_tiny", device="cpu", dtype="float32").params()
    assert (plain.edit_threshold, plain.max_post_edit_steps) == (1.0, 0)  # off unless the folder sets them
    assert engine.params({"edit_threshold": 1.0}).edit_threshold == 1.0  # a user's setting over the folder's
