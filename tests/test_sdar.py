"""SDAR (dense), against outputs of its own code (JetAstra/SDAR: modeling_sdar.py, generate.py's
`block_diffusion_generate`) on a tiny checkpoint saved by `save_pretrained`, made in a scratch environment
outside this project (provenance and the shims around the reference in the JSON).

generate.py's settings map onto the block strategies': `block_length` and `denoising_steps` (`block_steps`);
`low_confidence_dynamic` at a threshold is Celeris's rule (the scheduled top-k, and every masked position above
the threshold); `low_confidence_static` is the same with no threshold (1.0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.folder import ModelFolder
from celeris_cli.arch.sdar import SDARModel
from celeris_cli.decode.strategies import SpecialTokens

DATA = Path(__file__).parent / "data" / "sdar"
FOLDER = DATA / "sdar_tiny"
REF = json.loads((DATA / "sdar_reference.json").read_text(encoding="utf-8"))
CASES = REF["generate"]["cases"]
MASK = REF["ids"]["mask"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def test_config_json_chooses_sdar_its_block_strategies_and_special_ids(engine) -> None:  # type: ignore[no-untyped-def]
    folder = ModelFolder.open(FOLDER)
    assert folder.arch.name == "sdar" and folder.arch.strategies == ("block-fast", "block")
    assert engine.tokenizer.mask_id == REF["ids"]["mask"] == engine.tokenizer.backend.find("<|MASK|>")
    assert engine.tokenizer.eot_id == REF["ids"]["<|im_end|>"]
    assert engine.special.stop_ids == frozenset(REF["ids"]["generation_config_eos"])
    p = engine.params()
    assert (p.strategy, p.block_length, p.block_steps, p.threshold) == ("block-fast", 4, 4, 0.85)
    assert engine.tokenizer.chat_template  # from chat_template.jinja


def test_tensor_names_as_its_code_saves_them_load_without_renaming() -> None:
    from safetensors import safe_open

    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    model = load_model(FOLDER)
    assert isinstance(model, SDARModel) and model.block_causal
    assert saved == set(model.state_dict())
    assert "model.layers.1.self_attn.q_norm.weight" in saved


def test_logits_under_the_block_causal_mask_equal_the_reference_in_float32() -> None:
    from safetensors.torch import load_file

    model = load_model(FOLDER)
    expected = load_file(str(DATA / "logits.safetensors"))
    real = expected["attention_mask_2d"].bool()
    for width in (4, 8):
        got = model(expected["input_ids"], expected[f"mask_block{width}"], expected["position_ids"])
        want = expected[f"logits_block{width}"]
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


def settings(kw: dict[str, Any], strategy: str) -> dict[str, Any]:
    """generate.py's keyword arguments as Celeris settings."""
    rule = kw["remasking_strategy"]
    threshold = kw.get("confidence_threshold", 0.85) if rule == "low_confidence_dynamic" else 1.0
    return {
        "strategy": strategy,
        "remasking": "sequential" if rule == "sequential" else "low_confidence",
        "gen_length": kw["gen_length"],
        "block_length": kw["block_length"],
        "block_steps": kw["denoising_steps"],
        "threshold": threshold,
        "temperature": kw["temperature"],
        "top_k": kw["top_k"],
        "top_p": kw["top_p"],
    }


def through_stop(ids: list[int], stops: frozenset[int]) -> list[int]:
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    return ids if cut is None else ids[: cut + 1]


def rewrites(case: dict[str, Any], mask: int) -> bool:
    """Whether some step of generate.py scheduled more commits than its block had masked positions: its
    top-k then picks (and rewrites) already-decided positions, the prompt's own tokens included, where
    Celeris commits masked positions only (see docs/models.md). Read from the case's forward trace."""
    kw = case["generate_kwargs"]
    W, steps = kw["block_length"], kw["denoising_steps"]
    k = [W // steps + (1 if i < W % steps else 0) for i in range(steps)]
    step, start = 0, None
    for call in case["forward_trace"]:
        if call["store_kv"]:
            step, start = 0, None
            continue
        step = step + 1 if call["start"] == start else 0
        start = call["start"]
        if call["ids"].count(mask) < k[step]:
            return True
    return False


def expressible(case: dict[str, Any], mask: int) -> bool:
    """Every case but the steps generate.py rewrites decided tokens in (`rewrites`)."""
    return not rewrites(case, mask)


def test_the_cases_left_out_are_the_ones_generate_py_rewrites_in() -> None:
    """The parity cases cover every setting, `sequential` (remasking: sequential) too; the rewriting quirk is
    found by the trace."""
    assert any(rewrites(c, MASK) for c in CASES if c["prompt_rewritten"])
    kept = {c["setting"] for c in CASES if expressible(c, MASK)}
    assert kept == {c["setting"] for c in CASES}, kept
    assert sum(c["generate_kwargs"]["remasking_strategy"] == "sequential" for c in CASES if expressible(c, MASK)) == 4


@pytest.mark.parametrize("strategy", ["block-fast", "block"])
@pytest.mark.parametrize(
    "case", [c for c in CASES if expressible(c, MASK)], ids=lambda c: f"{c['prompt']}-{c['setting']}-{c['stop']}"
)
def test_greedy_generation_equals_sdar_generate(engine, case, strategy) -> None:  # type: ignore[no-untyped-def]
    kw = case["generate_kwargs"]
    stops = frozenset(kw["stopping_criteria_idx"] or {REF["ids"]["vocab_size"] - 1})  # unused: every block runs
    engine.special = SpecialTokens(engine.tokenizer.mask_id, stops, engine.tokenizer.pad_id)
    try:
        outs, _ = engine.decode_ids([case["input_ids"]], engine.params(settings(kw, strategy)))
    finally:
        engine.special = SpecialTokens(engine.tokenizer.mask_id, engine.tokenizer.stop_ids, engine.tokenizer.pad_id)
    want = case["generated_ids"][: kw["gen_length"]]
    assert through_stop(outs[0], stops) == through_stop(want, stops)


def _prompts() -> list[list[int]]:
    seen: dict[str, list[int]] = {}
    for c in CASES:
        seen.setdefault(c["prompt"], c["input_ids"])
    return list(seen.values())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("strategy", ["block-fast", "block"])
def test_batched_rows_equal_each_row_alone(engine, strategy, temperature) -> None:  # type: ignore[no-untyped-def]
    """generate.py cannot decode a batch (it builds a canvas of one row, and passes no padding mask); Celeris
    left-pads by whole blocks and masks the padding, so no row's answer moves."""
    prompts = _prompts()
    assert len({len(p) % 4 for p in prompts}) > 1
    params = engine.params({"strategy": strategy, "gen_length": 24, "temperature": temperature})
    together, _ = engine.decode_ids(prompts, params)
    alone = [engine.decode_ids([p], params)[0][0] for p in prompts]
    assert [engine.finish(o)[0] for o in together] == [engine.finish(o)[0] for o in alone]
