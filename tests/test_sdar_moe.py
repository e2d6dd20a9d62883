"""SDAR-MoE (SDARMoeForCausalLM): the forward against transformers' Qwen3-MoE (SDAR-MoE's own modeling file
is in no reachable repository; its routing is the SDAR team's engine's), the decoding against SDAR's own
generate.py, on a tiny checkpoint in the Qwen3-MoE layout made in a scratch environment outside this project
(provenance in the JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.qwen3 import SoftmaxMoE
from celeris_cli.decode.strategies import SpecialTokens

from .conftest import family_head
from .test_sdar import settings, through_stop

DATA = Path(__file__).parent / "data" / "sdar_moe"
FOLDER = DATA / "sdarmoe_tiny"
REF = json.loads((DATA / "sdarmoe_reference.json").read_text(encoding="utf-8"))
CASES = REF["generate"]["cases"]
MASK = REF["ids"]["mask"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return family_head(load_engine(FOLDER, device="cpu", dtype="float32"))  # recorded with the family's own code


def test_logits_and_routing_equal_qwen3_moe_under_the_block_causal_mask() -> None:
    from safetensors.torch import load_file

    model = load_model(FOLDER)
    expected = load_file(str(DATA / "logits.safetensors"))
    real = expected["attention_mask_2d"].bool()
    with torch.no_grad():
        for width in (4, 8):
            got = model(expected["input_ids"], expected[f"mask_block{width}"], expected["position_ids"])
            torch.testing.assert_close(got[real], expected[f"logits_block{width}"][real], atol=1e-4, rtol=1e-4)
        for layer in (0, 1):
            moe = model.model.layers[layer].mlp
            assert isinstance(moe, SoftmaxMoE) and moe.routing.norm_topk_prob
            chosen, weights = moe.route(expected[f"router.layer{layer}.gate_input"])
            assert torch.equal(chosen, expected[f"router.layer{layer}.topk_idx"])
            torch.testing.assert_close(weights, expected[f"router.layer{layer}.topk_weight"])
            torch.testing.assert_close(weights.sum(-1), torch.ones(len(weights)))  # renormalised


@pytest.mark.parametrize("strategy", ["block-fast", "block"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['prompt']}-{c['setting']}")
def test_greedy_generation_equals_sdar_generate(engine, case, strategy) -> None:  # type: ignore[no-untyped-def]
    kw = case["generate_kwargs"]
    stops = frozenset(kw["stopping_criteria_idx"] or {REF["ids"]["vocab_size"] - 1})
    engine.special = SpecialTokens(engine.tokenizer.mask_id, stops, engine.tokenizer.pad_id)
    try:
        outs, _ = engine.decode_ids([case["input_ids"]], engine.params(settings(kw, strategy)))
    finally:
        engine.special = SpecialTokens(engine.tokenizer.mask_id, engine.tokenizer.stop_ids, engine.tokenizer.pad_id)
    assert through_stop(outs[0], stops) == through_stop(case["generated_ids"][: kw["gen_length"]], stops)


@pytest.mark.parametrize("strategy", ["block-fast", "block"])
def test_batched_rows_equal_each_row_alone_whatever_their_batch_mates_route_to(engine, strategy) -> None:  # type: ignore[no-untyped-def]
    prompts = list({c["prompt"]: c["input_ids"] for c in CASES}.values())
    params = engine.params({"strategy": strategy, "gen_length": 24, "temperature": 0.0})
    together, _ = engine.decode_ids(prompts, params)
    alone = [engine.decode_ids([p], params)[0][0] for p in prompts]
    assert [engine.finish(o)[0] for o in together] == [engine.finish(o)[0] for o in alone]
