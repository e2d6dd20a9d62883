"""LLaDA-MoE, against outputs of its own code (the inclusionAI modeling_lladamoe.py as vendored in
InfiniTensor/InfiniLM, and LLaDA's generate.py) on a tiny checkpoint saved by `save_pretrained`, made in a
scratch environment outside this project (provenance in the JSON). Its config says `model_type` "llada", as
LLaDA-8B's does: the class in `architectures` tells them apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.llada_moe import LLaDAMoEModel

from .conftest import family_head

DATA = Path(__file__).parent / "data" / "llada_moe"
FOLDER = DATA / "lladamoe_tiny"
REF = json.loads((DATA / "lladamoe_reference.json").read_text(encoding="utf-8"))
CASES = REF["generate"]["cases"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return family_head(load_engine(FOLDER, device="cpu", dtype="float32"))  # recorded with the family's own code


def test_its_class_chooses_llada_moe_its_special_ids_and_llada_strategies(engine) -> None:  # type: ignore[no-untyped-def]
    assert engine.arch.name == "llada_moe" and engine.arch.strategies == ("fast", "reference")
    ids = REF["ids"]
    assert (engine.tokenizer.mask_id, engine.tokenizer.eos_id) == (ids["mask"], ids["eos"])
    assert engine.tokenizer.eot_id == ids["<|role_end|>"]


def test_tensor_names_as_its_code_saves_them_load_without_renaming() -> None:
    from safetensors import safe_open

    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    model = load_model(FOLDER)
    assert isinstance(model, LLaDAMoEModel)
    assert saved == set(model.state_dict())
    for name in ("self_attn.q_norm.weight", "mlp.gate.weight", "mlp.experts.7.down_proj.weight"):
        assert f"model.layers.1.{name}" in saved


def test_logits_and_routing_equal_the_reference_in_float32() -> None:
    """Its code attends padding (it drops the mask), so the padded row is compared as its code computes
    it, with no mask, and alone."""
    from safetensors.torch import load_file

    model = load_model(FOLDER)
    expected = load_file(str(DATA / "logits.safetensors"))
    real = expected["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(model(expected["input_ids"]), expected["logits"], atol=1e-4, rtol=1e-4)
        alone = model(expected["input_ids"][1][real[1]][None])
        torch.testing.assert_close(alone, expected["logits_row1_alone"], atol=1e-4, rtol=1e-4)
        for layer in (0, 1):
            moe = model.model.layers[layer].mlp
            chosen, weights = moe.route(expected[f"router.layer{layer}.gate_input"])
            want_idx = expected[f"router.layer{layer}.topk_idx"]
            assert torch.equal(chosen, want_idx)
            torch.testing.assert_close(weights, expected[f"router.layer{layer}.topk_weight"])
            assert not torch.allclose(weights.sum(-1), torch.ones(len(weights)))  # never renormalised


def _settings(kw: dict, strategy: str = "reference") -> dict:  # type: ignore[type-arg]
    keys = ("temperature", "cfg_scale", "remasking", "gen_length", "block_length")
    return {"strategy": strategy, "denoise_steps": kw["steps"], **{k: kw[k] for k in keys}}


@pytest.mark.parametrize(
    "case", CASES + REF["generate"]["cfg_cases"], ids=lambda c: f"{c['prompt']}-{c['generate_kwargs']}"
)
def test_greedy_generation_equals_llada_generate(engine, case) -> None:  # type: ignore[no-untyped-def]
    outs, _ = engine.decode_ids([case["input_ids"]], engine.params(_settings(case["generate_kwargs"])))
    assert outs[0] == case["generated_ids"]


@pytest.mark.parametrize("strategy", ["reference", "fast"])
def test_batched_rows_equal_each_row_alone(engine, strategy) -> None:  # type: ignore[no-untyped-def]
    """LLaDA-MoE's own code attends the left padding, so its batched rows move (`rows_equal_alone`);
    Celeris masks padding and gives each row its alone answer."""
    batched = REF["generate"]["batched"]
    kw = batched["generate_kwargs"]
    prompts = [
        [t for t, m in zip(ids, mask) if m] for ids, mask in zip(batched["input_ids"], batched["attention_mask"])
    ]
    params = engine.params(_settings(kw, strategy))
    together, _ = engine.decode_ids(prompts, params)
    alone = [engine.decode_ids([p], params)[0][0] for p in prompts]
    assert together == alone
    if strategy == "reference":
        by_prompt = {c["prompt"]: c["generated_ids"] for c in CASES if c["generate_kwargs"] == kw}
        assert together == [by_prompt[name] for name in batched["prompts"]]
    assert not all(batched["rows_equal_alone"])
