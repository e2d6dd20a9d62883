"""RND1, its forward against its own modeling code (RadicalNumerics/RND1: modeling_rnd.py) on a tiny
checkpoint saved by `save_pretrained`, made in a scratch environment outside this project (provenance, and
the one shim its config class needed, in the JSON). Its own sampler, the default strategy, is checked in
`test_rnd1_sampler.py`; Dream's strategies run it too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.rnd1 import RND1Model

DATA = Path(__file__).parent / "data" / "rnd1"
FOLDER = DATA / "rnd1_tiny"
REF = json.loads((DATA / "rnd1_reference.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def test_its_mask_is_the_row_after_the_tokenizer_and_its_pad_ends_the_text(engine) -> None:  # type: ignore[no-untyped-def]
    ids = REF["ids"]
    assert engine.arch.name == "rnd1" and engine.model.logit_shift == 1
    assert engine.tokenizer.mask_id == ids["mask"] == engine.tokenizer.backend.size() == ids["tokenizer_len"]
    assert engine.tokenizer.eos_id == ids["eos"] and engine.params().strategy == "rnd1"
    assert engine.special.stop_ids == {ids["eos"], ids["pad"]} and engine.special.pad_id == ids["pad"]
    assert set(engine.arch.strategies) == {"rnd1", "dream", "fast", "reference"}


def test_tensor_names_logits_and_routing_equal_its_own_code_in_float32() -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    model = load_model(FOLDER)
    assert isinstance(model, RND1Model) and saved == set(model.state_dict())
    expected = load_file(str(DATA / "logits.safetensors"))
    real = expected["attention_mask_2d"].bool()
    with torch.no_grad():
        torch.testing.assert_close(model(expected["input_ids"]), expected["logits"], atol=1e-4, rtol=1e-4)
        alone = model(expected["input_ids"][1][real[1]][None])
        torch.testing.assert_close(alone, expected["logits_row1_alone"], atol=1e-4, rtol=1e-4)
        for layer in (0, 1):
            chosen, weights = model.model.layers[layer].mlp.route(expected[f"router.layer{layer}.gate_input"])
            assert torch.equal(chosen, expected[f"router.layer{layer}.topk_idx"])
            torch.testing.assert_close(weights, expected[f"router.layer{layer}.topk_weight"])


@pytest.mark.parametrize("strategy", ["dream", "fast"])
def test_batched_rows_equal_each_row_alone(engine, strategy) -> None:  # type: ignore[no-untyped-def]
    prompts = [list(p) for p in dict.fromkeys(tuple(c["input_ids"]) for c in REF["generate"]["cases"])]
    assert len({len(p) for p in prompts}) > 1
    params = engine.params({"strategy": strategy, "gen_length": 16, "denoise_steps": 8, "temperature": 0.0})
    together, _ = engine.decode_ids(prompts, params)
    assert together == [engine.decode_ids([p], params)[0][0] for p in prompts]
