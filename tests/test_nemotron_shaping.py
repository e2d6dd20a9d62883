"""The diffusion mode (`nemotron`) honours the shaping knobs (presence penalty, min_tokens, subword_min_p), so
a model's Latin preset reaches it: before, the strategy declared no shaping and a preset's shaping knobs were
dropped as knobs it does not honour (English word validity 0.893 under `--set '{"strategy":"nemotron"}'`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celeris_cli import load_engine

SPEC = Path(__file__).parents[1] / "celeris_cli" / "models" / "celeris-spec"
POEMS = ["床前明月光，", "春眠不觉晓，", "白日依山尽，", "红豆生南国，"]
ENGLISH = ["The jury said it", "To be, or not", "Shall I compare thee", "It was the best of"]
# one commit per step (3 masked positions a block, 3 steps each): every position sees all before it
ONE_BY_ONE = {"strategy": "nemotron", "gen_length": 24, "block_length": 4, "block_steps": 3}


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(SPEC, device="cpu", dtype="float32")


def _ids(engine: Any, prompts: list[str], **settings: Any) -> list[list[int]]:
    params = engine.params({**ONE_BY_ONE, **settings})
    return engine.decode_ids([engine.encode_prompt(p) for p in prompts], params, seeds=list(range(len(prompts))))[0]


def _answer(engine: Any, ids: list[int]) -> list[int]:
    """The ids before the first stop token."""
    stops = engine.answer_stops()
    return ids[: next((i for i, t in enumerate(ids) if t in stops), len(ids))]


def test_the_latin_preset_reaches_the_diffusion_mode(engine) -> None:  # type: ignore[no-untyped-def]
    preset = json.loads((SPEC / "generation_config.json").read_text())["by_script"]["latin"]
    shaping = {k: v for k, v in preset.items() if k in ("presence_penalty", "min_tokens", "subword_min_p")}
    assert shaping  # the preset this test is about
    [result] = engine.generate(ENGLISH[:1], engine.params({"strategy": "nemotron", "gen_length": 8}))
    assert {k: result.settings[k] for k in shaping} == shaping


def test_a_large_presence_penalty_repeats_no_token(engine) -> None:  # type: ignore[no-untyped-def]
    """Greedy, one commit per step, the seeds included: a penalty of 100 leaves no token twice in an answer
    (the oracle counts tokens), where the same decode without it repeats some."""
    plain = [_answer(engine, a) for a in _ids(engine, POEMS + ENGLISH, temperature=0.0)]
    assert any(len(set(a)) < len(a) for a in plain)
    for a in _ids(engine, POEMS + ENGLISH, temperature=0.0, presence_penalty=100.0):
        a = _answer(engine, a)
        assert len(set(a)) == len(a), a


def test_min_tokens_keeps_the_stop_tokens_out_of_the_first_positions(engine) -> None:  # type: ignore[no-untyped-def]
    """The poems end in under 20 tokens unshaped; with min_tokens 20 no stop token comes before position 20."""
    assert any(len(_answer(engine, a)) < 20 for a in _ids(engine, POEMS, temperature=1.0))
    for a in _ids(engine, POEMS, temperature=1.0, min_tokens=20):
        assert len(_answer(engine, a)) >= 20, a


def test_subword_min_p_changes_the_sampled_english(engine) -> None:  # type: ignore[no-untyped-def]
    assert _ids(engine, ENGLISH, temperature=1.0, subword_min_p=0.9) != _ids(engine, ENGLISH, temperature=1.0)


def test_a_threshold_with_fewer_steps_than_masks_still_fills_every_block(engine) -> None:  # type: ignore[no-untyped-def]
    """Blocks of 16 in 4 steps with a threshold no prediction reaches: each step commits the schedule's share
    besides the sure ones, so no mask is left in an answer (it once committed one a step, and a block ran out
    of steps with masks in it)."""
    mask = engine.special.mask_id
    for a in _ids(engine, POEMS + ENGLISH, block_length=16, block_steps=1, threshold=0.999, temperature=1.0):
        assert mask not in a, a
