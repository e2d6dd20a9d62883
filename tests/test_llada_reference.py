"""A LLaDA folder exactly as `transformers` saves it (config.json with its bookkeeping keys, HF's
generation_config.json, tokenizer.json) loads, and reference decoding matches LLaDA's own `generate.py`
token for token at temperature 0 in float32.

The expected ids in tests/data/llada_hf_reference.json were made outside this project with LLaDA's own
modeling and generation code; its "source" field names the repositories, commits and versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celeris_cli import load_engine
from celeris_cli.engine import Engine

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "llada_hf_reference.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def llada() -> Engine:
    return load_engine(DATA / REFERENCE["folder"], device="cpu", dtype="float32")


def test_the_folder_is_as_transformers_saves_it(llada: Engine) -> None:
    gc = json.loads((DATA / REFERENCE["folder"] / "generation_config.json").read_text())
    assert gc["_from_model_config"] is True and "transformers_version" in gc  # the keys that used to be rejected
    assert llada.special.stop_ids == {gc["eos_token_id"], 387}  # eos, and <|eot_id|> found in the tokenizer
    assert llada.special.mask_id == 386


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"{c['prompt'][:6]}-{c['settings']}")
def test_reference_decoding_matches_llada_generate_py(llada: Engine, case: dict) -> None:
    params = llada.params({**case["settings"], "strategy": "reference"})
    assert llada.encode_prompt(case["prompt"]) == case["prompt_ids"]
    [out], nfe = llada.decode_ids([case["prompt_ids"]], params)
    assert out == case["output_ids"]
    # generate.py runs guidance as one doubled batch; each of its calls is two forward passes
    assert nfe == case["nfe"] * (2 if params.cfg_scale > 0 else 1)


@pytest.mark.parametrize("case", REFERENCE["batched"], ids=lambda c: str(c["settings"]))
def test_left_padded_batch_matches_llada_generate_py(llada: Engine, case: dict) -> None:
    params = llada.params({**case["settings"], "strategy": "reference"})
    outs, _ = llada.decode_ids(case["prompt_ids"], params)
    assert outs == case["output_ids"]
