"""CoDA, against outputs of its own code (SalesforceAIResearch/CoDA: modeling_coda.py and its
`diffusion_generate`) on a tiny checkpoint saved by `save_pretrained`, made in a scratch environment outside
this project (provenance in the JSON). CoDA's generation is Dream's algorithm (maskgit_plus, topk_margin,
entropy over a linear timeline to eps) over shifted logits: Celeris's `dream` strategy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.coda import CoDAModel
from celeris_cli.arch.folder import ModelFolder

from .conftest import family_head

DATA = Path(__file__).parent / "data" / "coda"
FOLDER = DATA / "coda_tiny"
REF = json.loads((DATA / "coda_reference.json").read_text(encoding="utf-8"))
CASES = REF["generate"]["cases"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return family_head(load_engine(FOLDER, device="cpu", dtype="float32"))  # recorded with the family's own code


def test_config_json_chooses_coda_with_its_tokenizers_eos_and_dreams_strategy(engine) -> None:  # type: ignore[no-untyped-def]
    folder = ModelFolder.open(FOLDER)
    assert folder.arch.name == "coda" and folder.config.get("eos_token_id") is None
    assert (engine.tokenizer.mask_id, engine.tokenizer.eos_id) == (REF["ids"]["mask"], REF["ids"]["eos"])
    assert engine.model.logit_shift == 1 and not engine.model.block_causal
    assert engine.params().strategy == "dream"


def test_its_hand_written_generation_config_is_not_read_as_its_code_does_not() -> None:
    """CoDA's generation_config.json says alg "original", which its own code refuses; it is never read."""
    assert json.loads((FOLDER / "generation_config.json").read_text())["alg"] == "original"
    folder = ModelFolder.open(FOLDER)
    assert folder.generation == {} and folder.defaults().alg == "maskgit_plus"


def test_logits_equal_the_reference_in_float32_and_the_head_is_never_tied() -> None:
    from safetensors.torch import load_file

    model = load_model(FOLDER)
    assert isinstance(model, CoDAModel)
    assert not torch.equal(model.head_weight(), model.model.embed_tokens.weight)
    expected = load_file(str(DATA / "logits.safetensors"))
    real = expected["attention_mask"].bool()
    full = real.all(1)
    assert full.any() and not full.all()  # one row with padding, one without
    with torch.no_grad():
        got = model(expected["input_ids"][full])  # CoDA's forward attends everything: compare the unpadded row
        torch.testing.assert_close(got, expected["logits"][full], atol=1e-4, rtol=1e-4)
        alone = model(expected["input_ids"][~full][real[~full]][None])
    torch.testing.assert_close(alone, expected["logits_row1_alone"], atol=1e-4, rtol=1e-4)


def _settings(kw: dict) -> dict:  # type: ignore[type-arg]
    return {
        "strategy": "dream",
        "gen_length": kw["max_new_tokens"],
        "denoise_steps": kw["steps"],
        "eps": kw["eps"],
        "alg": kw["alg"],
        "temperature": kw["temperature"],
    }


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['prompt']}-{c['generate_kwargs']['alg']}-{c['generate_kwargs']['steps']}"
)
def test_greedy_generation_equals_coda_diffusion_generate(engine, case) -> None:  # type: ignore[no-untyped-def]
    outs, _ = engine.decode_ids([case["input_ids"]], engine.params(_settings(case["generate_kwargs"])))
    assert outs[0] == case["generated_ids"]


def test_batched_rows_equal_coda_alone_although_its_own_batch_does_not(engine) -> None:  # type: ignore[no-untyped-def]
    """CoDA's own batch attends the left padding (its forward drops the mask), so its padded rows differ
    from the same prompts alone; Celeris masks padding and gives each row its alone answer."""
    batched = REF["generate"]["batched"]
    kw = batched["generate_kwargs"]
    alone = {c["prompt"]: c["generated_ids"] for c in CASES if c["generate_kwargs"] == kw}
    prompts = [
        [t for t, m in zip(ids, mask) if m] for ids, mask in zip(batched["input_ids"], batched["attention_mask"])
    ]
    outs, _ = engine.decode_ids(prompts, engine.params(_settings(kw)))
    assert outs == [alone[name] for name in batched["prompts"]]
    assert not all(batched["rows_equal_alone"])  # the family's own batch moved a row
