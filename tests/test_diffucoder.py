"""DiffuCoder (a `DreamModel` with DiffuCoder's tokens), against Dream's own modeling and generation code
driven as DiffuCoder's inference demo drives it, on a tiny checkpoint saved by `save_pretrained` and trained
to end its answers in `<|dlm_pad|>` runs, made in a scratch environment outside this project (provenance in
the JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celeris_cli import load_engine

DATA = Path(__file__).parent / "data" / "diffucoder"
FOLDER = DATA / "diffucoder_tiny"
REF = json.loads((DATA / "diffucoder_reference.json").read_text(encoding="utf-8"))
CASES = REF["generate"]["cases"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def _settings(kw: dict, strategy: str = "dream") -> dict:  # type: ignore[type-arg]
    """The demo passes no top_k, but Dream's generation config runs with its legacy top_k 50: at temperature
    0 it changes no argmax, only the confidences that order the unmasking."""
    return {
        "strategy": strategy,
        "gen_length": kw["max_new_tokens"],
        "denoise_steps": kw["steps"],
        "alg": kw["alg"],
        "temperature": kw["temperature"],
        "top_p": kw["top_p"],
        "top_k": 50,
    }


def test_it_loads_as_dream_and_its_dlm_pad_is_a_stop_token(engine) -> None:  # type: ignore[no-untyped-def]
    assert engine.arch.name == "dream" and engine.model.logit_shift == 1
    pad = engine.tokenizer.backend.find("<|dlm_pad|>")
    assert pad == engine.tokenizer.pad_id and pad in engine.special.stop_ids


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['prompt']}-{c['generate_kwargs']['alg']}-{c['generate_kwargs']['steps']}"
)
def test_greedy_generation_equals_dreams_diffusion_generate(engine, case) -> None:  # type: ignore[no-untyped-def]
    outs, _ = engine.decode_ids([case["input_ids"]], engine.params(_settings(case["generate_kwargs"])))
    assert outs[0] == case["generated_ids"]


def test_the_answer_is_cut_at_the_first_dlm_pad_as_its_demo_cuts_it(engine) -> None:  # type: ignore[no-untyped-def]
    """Instruct: everything before the first `<|dlm_pad|>`. Celeris also ends an answer at its end of turn
    (`<|im_end|>`), which the demo keeps in its text; the cases compared have none before their pads."""
    pad = engine.tokenizer.backend.find("<|dlm_pad|>")
    cut = [c for c in CASES if not c["prompt"].startswith("base_") and pad in c["generated_ids"]]
    cut = [c for c in cut if "<|im_end|>" not in c["cut_text"]]
    assert cut
    for case in cut:
        text, _, reason = engine.finish(case["generated_ids"], prompt=case["input_ids"])
        assert (text, reason) == (case["cut_text"], "stop")


def test_batched_rows_equal_each_row_alone_and_dreams_own_batch(engine) -> None:  # type: ignore[no-untyped-def]
    batched = REF["generate"]["batched"]
    prompts = [
        [t for t, m in zip(ids, mask) if m] for ids, mask in zip(batched["input_ids"], batched["attention_mask"])
    ]
    params = engine.params(_settings(batched["generate_kwargs"]))
    outs, _ = engine.decode_ids(prompts, params)
    assert outs == batched["generated_ids"]
    assert outs == [engine.decode_ids([p], params)[0][0] for p in prompts]
