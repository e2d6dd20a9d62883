"""A step's LM head and sampling run on at most `Net.chunk` positions at a time (`predict.in_chunks`), so a
wide batch on a long block never holds the logits of all its positions at once: every decoder's answers are
the same whatever the chunk, and no call of the head sees more positions than it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.memory import Request, Shape, plan
from celeris_cli.arch.memory_sizes import LOGIT_COPIES, WHOLE_DRAW_BYTES, logit_chunk
from celeris_cli.decode.strategies import Net

DATA = Path(__file__).parent / "data"
CHUNK = 5  # odd, so a row's positions fall across chunks


class Chunked(Net):
    """The engine's Net with a chunk of CHUNK positions, recording how many positions each head call saw,
    per head made ready for a step (`step_head`)."""

    calls: list[list[int]] = []  # per step_head(): the positions of each of its calls

    def __init__(self, model: Any, chunk: int | None = None) -> None:
        super().__init__(model, chunk=CHUNK)

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        head, widths = super().step_head(), []
        Chunked.calls.append(widths)

        def recorded(h: torch.Tensor) -> torch.Tensor:
            widths.append(h.numel() // h.shape[-1])
            return head(h)

        return recorded


def _prompts(engine: Any) -> list[list[int]]:
    return [engine.encode_prompt(p) for p in ("床前明月光，", "The quick brown fox", "def add(a, b):\n")]


CASES = [  # (model folder, or None for the session's tiny LLaDA model; settings)
    (None, {"strategy": "reference", "gen_length": 16, "block_length": 8, "steps": 8, "temperature": 1.0}),
    (None, {"strategy": "reference", "gen_length": 16, "block_length": 16, "steps": 4, "cfg_scale": 1.0}),
    (None, {"strategy": "fast", "gen_length": 24, "block_length": 12, "temperature": 0.8, "min_tokens": 6}),
    (None, {"strategy": "fast", "gen_length": 16, "block_length": 16, "cfg_scale": 1.0, "presence_penalty": 0.5}),
    ("dream/dream_tiny", {"strategy": "dream", "gen_length": 16, "steps": 4, "temperature": 0.7}),
    ("dream/dream_tiny", {"strategy": "dream", "gen_length": 16, "steps": 4, "alg": "entropy"}),
    ("rnd1/rnd1_tiny", {"strategy": "rnd1", "gen_length": 16, "denoise_steps": 4, "temperature": 0.7}),
    ("llada2/llada2_tiny", {"strategy": "block", "gen_length": 16, "block_length": 8, "edit_threshold": 0.5}),
    ("llada2/llada2_tiny", {"strategy": "block-fast", "gen_length": 16, "block_length": 8, "temperature": 0.9}),
    ("nemotron/nemotron_tiny", {"strategy": "nemotron", "gen_length": 12, "temperature": 0.9}),
    ("nemotron/nemotron_tiny", {"strategy": "nemotron-spec", "gen_length": 12, "temperature": 0.9}),
]


@pytest.mark.parametrize("folder,settings", CASES, ids=[f"{s['strategy']}-{i}" for i, (_, s) in enumerate(CASES)])
def test_answers_do_not_depend_on_the_chunk_and_no_head_call_exceeds_it(
    engine: Any, folder: str | None, settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = engine if folder is None else load_engine(DATA / folder, device="cpu", dtype="float32")
    params = eng.params(settings)
    prompts = _prompts(eng)
    whole, _ = eng.decode_ids(prompts, params)
    Chunked.calls = []
    monkeypatch.setattr("celeris_cli.engine.Net", Chunked)
    chunked, _ = eng.decode_ids(prompts, params)
    assert chunked == whole
    assert max(w for step in Chunked.calls for w in step) <= CHUNK
    assert max(len(step) for step in Chunked.calls) > 1  # a step had more positions than a chunk: it was split


SAMPLED = json.loads((DATA / "sampled" / "sampled_answers.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "case", SAMPLED["cases"], ids=[f"{c['settings']['strategy']}-{i}" for i, c in enumerate(SAMPLED["cases"])]
)
def test_sampled_answers_are_those_drawn_before_the_head_ran_in_chunks(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each position draws the number of its row and place it drew when every step ran the head on the
    whole canvas (Dream and RND1 by the answer's column): answers recorded with the code before, at a seed,
    up to each one's first stop token (the static block decoder filled the rest of a finished row's block;
    its running set leaves the row at the step it finishes)."""
    eng = load_engine(DATA / case["folder"], device="cpu", dtype="float32")
    monkeypatch.setattr("celeris_cli.engine.Net", Chunked)
    outs, _ = eng.decode_ids(_prompts(eng), eng.params({**case["settings"], "seed": case["seed"]}))

    def to_stop(ids: list[int]) -> list[int]:
        ends = [i for i, t in enumerate(ids) if t in eng.special.stop_ids]
        return ids[: ends[0] + 1] if ends else ids

    assert [to_stop(o) for o in outs] == [to_stop(a) for a in case["answers"]]
    assert sum(len(to_stop(a)) for a in case["answers"]) > len(outs)  # more than stop tokens are compared


def test_the_chunk_holds_the_logit_budget_in_whole_row_tiles() -> None:
    assert logit_chunk(126_464) == 112  # LLaDA-8B: 512 MiB / (126,464 entries x 36 bytes) = 117.9
    assert logit_chunk(151_936) == 96  # Qwen's vocabulary: 98.2, down to the 16-row tile
    assert logit_chunk(40, budget=40 * WHOLE_DRAW_BYTES * 7) == 7  # under one tile: as many as fit
    assert logit_chunk(10**9) == 1  # never none


def test_the_planner_counts_a_chunk_of_logits_however_long_the_block() -> None:
    """The head's share of the peak stops growing once a step predicts more positions than a chunk: for
    the whole-canvas decoders (the head on the positions predicted, not the canvas) and the cached ones;
    a draw over the whole vocabulary keeps float64 copies beside each chunk."""
    V = 151_936
    shape = Shape(layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=128, rows=V,
                  matrix_params=2 * V * 64, matrix_rows=2 * V, other_params=0)  # fmt: skip
    for strategy in ("reference", "dream", "rnd1", "fast"):
        short = plan(shape, Request(strategy, batch=1, prompt=8, gen_length=8, block_length=8))
        long = Request(strategy, batch=16, prompt=64, gen_length=512, block_length=512)
        assert short.logits == 8 * V * 4 * LOGIT_COPIES  # fewer positions than a chunk: all of them
        assert plan(shape, long).logits == logit_chunk(V) * V * 4 * LOGIT_COPIES, strategy
        assert plan(shape, replace(long, whole_draw=True)).logits == logit_chunk(V) * V * WHOLE_DRAW_BYTES
    guided = plan(shape, Request("reference", batch=16, prompt=64, gen_length=512, block_length=512, views=2))
    assert guided.logits == 2 * logit_chunk(V) * V * 4 * LOGIT_COPIES  # a chunk in each view


@pytest.mark.parametrize(
    "settings,whole",
    [
        ({"temperature": 0.0}, False),
        ({"temperature": 1.0}, True),  # no filter: the draw runs over every token
        ({"temperature": 1.0, "min_p": 0.05}, False),  # the candidates min-p leaves
        ({"temperature": 1.0, "top_k": 20}, False),
        ({"strategy": "dream", "temperature": 0.2, "top_p": 0.95}, True),  # Dream filters over the vocabulary
        ({"strategy": "rnd1", "temperature": 1.0}, False),  # RND1's greedy tokens: no draw
        ({"strategy": "rnd1", "temperature": 1.0, "greedy": False}, True),
    ],
)
def test_a_request_draws_over_the_whole_vocabulary_only_when_sampling_without_a_filter(
    settings: dict[str, Any], whole: bool
) -> None:
    from celeris_cli.arch.memory import request_of
    from celeris_cli.params import GenerationParams

    params = GenerationParams.from_mapping({"strategy": "reference", **settings})
    assert request_of(params, batch=1, prompt=8, dtype="float32").whole_draw is whole  # what the planner is asked


def test_a_steps_head_makes_a_large_heads_float32_cast_once_for_all_its_chunks(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bfloat16 a large head is cast to float32 per call, not kept (LLaDA-8B's cast is 2 GB): a step's
    head (`step_head`) casts once for every chunk it serves, and gives the logits the plain head gives."""
    from celeris_cli.arch import layers
    from celeris_cli.arch.checkpoint import load_model

    model = load_model(tiny_model, "cpu", torch.bfloat16)
    monkeypatch.setattr(layers, "HEAD_CACHE_BYTES", 0)  # every head is large here: cast per call, never kept
    casts: list[int] = []
    cast = layers.DiffusionLM._float_head
    monkeypatch.setattr(layers.DiffusionLM, "_float_head", lambda self, w: casts.append(1) or cast(self, w))
    h = torch.randn(12, model.head_weight().shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    head = model.step_head()
    chunks = torch.cat([head(h[i : i + 4]) for i in range(0, 12, 4)])
    assert len(casts) == 1
    assert torch.equal(chunks, model.head(h))
