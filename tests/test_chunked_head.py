"""A step's LM head and sampling run on at most `Net.chunk` positions at a time (`predict.in_chunks`), so a
wide batch on a long block never holds the logits of all its positions at once: every decoder's answers are
the same whatever the chunk, and no call of the head sees more positions than it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.memory import LOGIT_COPIES, Request, Shape, logit_chunk, plan
from celeris_cli.decode.strategies import Net

DATA = Path(__file__).parent / "data"
CHUNK = 5  # odd, so a row's positions fall across chunks


class Chunked(Net):
    """The engine's Net with a chunk of CHUNK positions, recording how many positions each head call saw."""

    widths: list[int] = []

    def __init__(self, model: Any, chunk: int | None = None) -> None:
        super().__init__(model, chunk=CHUNK)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        Chunked.widths.append(h.numel() // h.shape[-1])
        return super().head(h)


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
    Chunked.widths = []
    monkeypatch.setattr("celeris_cli.engine.Net", Chunked)
    chunked, _ = eng.decode_ids(prompts, params)
    assert chunked == whole
    assert Chunked.widths and max(Chunked.widths) <= CHUNK
    assert Chunked.widths.count(CHUNK) > 0  # a step had more positions than a chunk: it was split


def test_the_chunk_holds_the_logit_budget_in_whole_row_tiles() -> None:
    assert logit_chunk(126_464) == 176  # LLaDA-8B: 256 MiB / (126,464 x 4 bytes x 3 copies) = 176.9
    assert logit_chunk(151_936) == 144  # Qwen's vocabulary: 147.2, down to the 16-row tile
    assert logit_chunk(40, budget=40 * 4 * LOGIT_COPIES * 7) == 7  # under one tile: as many as fit
    assert logit_chunk(10**9) == 1  # never none


def test_the_planner_counts_a_chunk_of_logits_however_long_the_block() -> None:
    """The head's share of the peak stops growing once a step predicts more positions than a chunk: for
    the whole-canvas decoders (the head on the positions predicted, not the canvas) and the cached ones."""
    shape = Shape(layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=128, rows=151_936,
                  matrix_params=2 * 151_936 * 64, matrix_rows=2 * 151_936, other_params=0)  # fmt: skip
    chunk_bytes = logit_chunk(151_936) * 151_936 * 4 * LOGIT_COPIES
    for strategy in ("reference", "dream", "rnd1", "fast"):
        short = plan(shape, Request(strategy, batch=1, prompt=8, gen_length=8, block_length=8))
        long = plan(shape, Request(strategy, batch=16, prompt=64, gen_length=512, block_length=512))
        assert short.logits == 8 * 151_936 * 4 * LOGIT_COPIES  # fewer positions than a chunk: all of them
        assert long.logits == chunk_bytes, strategy
    guided = plan(shape, Request("reference", batch=16, prompt=64, gen_length=512, block_length=512, views=2))
    assert guided.logits == 2 * chunk_bytes  # a chunk in each view
