"""RND1's own sampler (`--strategy rnd1`, `decode/rnd1.py`) against `diffusion_sample` in RadicalNumerics/RND1
87d5f46 (`rnd/sampling.py`), recorded through its `model.generate` on the tiny checkpoint its own code saved
(tests/data/rnd1: provenance in the JSON, the algorithm and its quirks in the README).

Every recorded case is greedy, so each is determined by the model and the ranking: at temperature 0, and
with top-k (whose filtered tokens make RND1's entropy NaN), every score ties and `torch.topk`'s order over
RND1's batch-of-one layout decides, which Celeris reproduces by ranking on the same layout (on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.decode.rnd1 import rnd1_log_probs
from celeris_cli.errors import UsageError
from celeris_cli.params import Filters, GenerationParams, model_layer

from .conftest import family_head
from .test_families_cli import celeris

DATA = Path(__file__).parent / "data" / "rnd1"
FOLDER = DATA / "rnd1_tiny"
REF = json.loads((DATA / "rnd1_reference.json").read_text(encoding="utf-8"))
CASES = REF["generate"]["cases"]
PROMPTS = [list(p) for p in dict.fromkeys(tuple(c["input_ids"]) for c in CASES)]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return family_head(load_engine(FOLDER, device="cpu", dtype="float32"))  # RND1's entropy spans all 384 rows


def settings(g: dict[str, Any]) -> dict[str, Any]:
    """An RND1GenerationConfig's fields as Celeris settings, through the generation_config.json mapping."""
    layer, _, _ = model_layer(g)
    return {"strategy": "rnd1", **layer}


def _id(case: dict[str, Any]) -> str:
    g = case["generation_config"]
    mode = f"eb{g['eb_gamma']}" if g["eb_gamma"] is not None else f"k{g['top_k']}" if g["top_k"] else "entropy"
    return f"p{len(case['input_ids'])}-T{g['temperature']}-{mode}-S{g['num_diffusion_steps']}-N{g['max_new_tokens']}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_recorded_case_equals_rnd1s_diffusion_sample_token_for_token(engine, case) -> None:  # type: ignore[no-untyped-def]
    outs, _ = engine.decode_ids([case["input_ids"]], engine.params(settings(case["generation_config"])))
    assert outs[0] == case["generated_ids"]


def test_its_own_sampler_is_the_default_and_its_generation_config_keys_map_onto_it(engine) -> None:  # type: ignore[no-untyped-def]
    assert engine.params().strategy == "rnd1" and engine.arch.strategies[0] == "rnd1"
    saved = {  # RND1GenerationConfig.to_dict() writes do_sample as `not greedy` beside greedy
        "num_diffusion_steps": 8, "max_new_tokens": 12, "temperature": 0.5, "top_k": 5, "top_p": None,
        "greedy": True, "do_sample": False, "eb_gamma": 0.25, "mask_token_id": 321, "pad_token_id": 316,
    }  # fmt: skip
    params = GenerationParams.defaults_from(engine.arch.layer(), model_layer(saved)[0])
    assert (params.strategy, params.denoise_steps, params.gen_length) == ("rnd1", 8, 12)
    assert (params.temperature, params.top_k, params.top_p, params.greedy, params.eb_gamma) == (0.5, 5, 1, True, 0.25)
    assert model_layer({"do_sample": False, "temperature": 0.5})[0]["temperature"] == 0.0  # others: greedy


def test_the_last_position_is_kept_as_padding_and_the_text_ends_before_it() -> None:
    """Through the command line, with RND1's default strategy: a recorded answer with padding before its
    reserved last position, whose text ends at the first pad."""
    text = "The quick"
    case = next(c for c in CASES if c["generation_config"]["temperature"] == 1.0 and c["input_ids"] == PROMPTS[0])
    g = case["generation_config"]
    p = celeris(
        "generate", "--model", str(FOLDER), "--prompt", text, "--gen-length", str(g["max_new_tokens"]),
        "--denoise-steps", str(g["num_diffusion_steps"]), "--temperature", "1", "--json", "--quiet", "--dtype",
        "float32",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    answer = case["generated_ids"]
    assert answer[-1] == REF["ids"]["pad"] and REF["ids"]["pad"] in answer[:-1]
    engine = load_engine(FOLDER, device="cpu", dtype="float32")
    assert engine.tokenizer.encode(text) == case["input_ids"]
    cut = answer[: answer.index(REF["ids"]["pad"])]
    assert r["settings"]["strategy"] == "rnd1" and r["finish_reason"] == "stop"
    assert r["text"] == engine.tokenizer.continuation(case["input_ids"], cut) and "<|endoftext|>" not in r["text"]


BATCH_SETTINGS = [
    {"temperature": 0.0},  # every entropy 0: the layout decides
    {"temperature": 1.0, "denoise_steps": 8},
    {"temperature": 0.5, "top_k": 5, "denoise_steps": 8},  # NaN entropies: the layout decides
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 1.0, "eb_gamma": 0.5},
    {"temperature": 1.0, "greedy": False, "seed": 5},
    {"temperature": 0.8, "greedy": False, "eb_gamma": 1.0, "seed": 9},
]


@pytest.mark.parametrize("extra", BATCH_SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_batched_left_padded_rows_equal_each_row_alone(engine, extra) -> None:  # type: ignore[no-untyped-def]
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS) > 1
    params = engine.params({"strategy": "rnd1", "gen_length": 16, "denoise_steps": 16, **extra})
    together, _ = engine.decode_ids(PROMPTS, params)
    assert together == [engine.decode_ids([p], params)[0][0] for p in PROMPTS]
    assert together[::-1] == engine.decode_ids(PROMPTS[::-1], params)[0]


def _answers(engine, **extra: Any) -> list[list[int]]:  # type: ignore[no-untyped-def]
    params = engine.params({"strategy": "rnd1", "gen_length": 16, "denoise_steps": 16, **extra})
    return engine.decode_ids(PROMPTS, params)[0]


@pytest.mark.parametrize(
    ("base", "changed"),
    [
        ({"temperature": 1.0}, {"greedy": False}),
        ({"temperature": 1.0, "greedy": False, "seed": 1}, {"seed": 2}),
        ({"temperature": 1.0}, {"eb_gamma": 0.5}),
        ({"temperature": 1.0, "eb_gamma": 0.5}, {"eb_gamma": 3.0}),
        ({"temperature": 1.0}, {"top_p": 0.5}),
        ({"temperature": 1.0}, {"top_k": 3}),
        ({"temperature": 1.0}, {"temperature": 0.3}),
        ({"temperature": 1.0}, {"denoise_steps": 4}),
        ({"temperature": 0.0}, {"strategy": "dream"}),
    ],
    ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()),
)
def test_each_setting_it_honours_changes_the_answers(engine, base, changed) -> None:  # type: ignore[no-untyped-def]
    assert _answers(engine, **base) != _answers(engine, **{**base, **changed})


def test_greedy_takes_the_likeliest_token_whatever_shapes_the_ranking(engine) -> None:  # type: ignore[no-untyped-def]
    """With greedy on, the temperature and the filters change which positions unmask when, not the token a
    position takes from a given canvas: one step (everything unmasks at once) gives the same answer."""
    one = [_answers(engine, denoise_steps=1, **s) for s in ({}, {"temperature": 2.0, "top_k": 3})]
    assert one[0] == one[1]


def test_under_top_k_the_entropy_is_nan_and_an_entropy_bound_unmasks_nothing_before_the_fill(engine) -> None:  # type: ignore[no-untyped-def]
    """RND1 sums -(p log p) over every token: the filtered ones give 0 x -inf = NaN, no bound holds, and
    the answer is the first forward's prediction everywhere, after a forward per step all the same."""
    bounded = engine.params({"strategy": "rnd1", "gen_length": 8, "denoise_steps": 4, "top_k": 5, "eb_gamma": 9.0})
    outs, nfe = engine.decode_ids(PROMPTS, bounded)
    assert nfe == 4 and outs == engine.decode_ids(PROMPTS, bounded.with_(denoise_steps=1))[0]


def test_top_p_keeps_the_two_likeliest_tokens_as_rnd1s_filter_does() -> None:
    logits = torch.tensor([[4.0, 1.0, 0.5, 0.0]])
    kept = rnd1_log_probs(logits, Filters(temperature=1.0, top_p=0.01, top_k=0)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    assert rnd1_log_probs(logits, Filters(1.0, 1.0, 2)).isfinite().tolist() == [[True, True, False, False]]


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"min_p": 0.1}, "min_p: not used by the rnd1 strategy"),
        ({"gen_length": 1}, "gen_length 1: the rnd1 strategy keeps"),
        ({"eb_gamma": -0.5}, "eb_gamma must be a finite number >= 0, or -1"),
        ({"strategy": "dream", "greedy": False}, "greedy: not used by the dream strategy"),
        ({"strategy": "fast", "eb_gamma": 0.5}, "eb_gamma: not used by the fast strategy"),
    ],
)
def test_settings_it_cannot_honour_are_refused_by_name(engine, given, named) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match=named):
        engine.params(given)


def test_more_steps_than_tokens_run_as_its_own_code_allows(engine) -> None:  # type: ignore[no-untyped-def]
    """RND1 runs every step, one forward first and one after each step that leaves a mask: 3 masks over 10
    steps keep floor(3 * s / 10) masked at s = 9 .. 3, so 6 steps leave some and the 7th clears them."""
    params = engine.params({"strategy": "rnd1", "gen_length": 4, "denoise_steps": 10})
    outs, nfe = engine.decode_ids([PROMPTS[0]], params)
    assert params.denoise_steps == 10 and nfe == 7 and outs[0][-1] == REF["ids"]["pad"]
