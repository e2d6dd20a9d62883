"""LLaDA2's reference block decoder (`block`) in the block running set (`decode.running`): its rows keep no
cache, and each round every one of them recomputes its prefix as a segment of one packed forward, block-causal
in its own blocks (`arch.packed`). Mixes drawn by hypothesis (prompts, answer lengths, block widths, steps,
samplers, thresholds, guidance, token editing, min_tokens, presence penalty, seeds, `block` beside
`block-fast`), rows joining while others
run and one dropped in flight, each answer equal to the same request decoded alone. The packed block-causal
segment is checked against the model's own forward under a mask written here; the decoder itself against
LLaDA2's `generate` by `test_llada2.py` and `test_llada21_editing.py` (the engine decodes through this set)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celeris_cli import load_engine
from celeris_cli.arch import invariant
from celeris_cli.arch.packed import packed_hidden
from celeris_cli.decode.running import BlockScheduler
from celeris_cli.decode.runset import RowRequest
from celeris_cli.decode.strategies import Net, plan_for
from celeris_cli.engine import Engine, _lane_of

DATA = Path(__file__).parent / "data"
PROMPTS = ["The cat", "a", "Once upon a time there was a small river", "hi there", "床前明月光，", "def f(x):"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(DATA / "llada2" / "llada2_tiny", device="cpu", dtype="float32")


def _scheduler(engine: Engine, width: int, net: Net | None = None, **kw: Any) -> BlockScheduler:
    s = engine.special
    return BlockScheduler(net or Net(engine.model), s.mask_id, s.stop_ids, s.pad_id, width, engine.device, **kw)


def _request(engine: Engine, key: int, row: dict[str, Any]) -> RowRequest[Any]:
    ids = engine.encode_prompt(row["prompt"])
    return RowRequest(key, ids, plan_for(engine.params(row["settings"])), row["seed"])


def _alone(engine: Engine, req: RowRequest[Any]) -> list[int]:
    [(_, ids, _)] = list(_scheduler(engine, 1).run([req]))
    return ids


def _row() -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def draw(d: st.DrawFn) -> dict[str, Any]:
        gen = d(st.integers(3, 20))
        W = d(st.sampled_from([w for w in (2, 4, 8) if w <= gen]))
        steps = (  # per block, or a total spread over the row's blocks
            {"block_steps": d(st.integers(1, W))} if d(st.booleans()) else {"denoise_steps": d(st.integers(1, gen))}
        )
        editing = d(st.booleans())
        row = {
            "strategy": d(st.sampled_from(["block", "block", "block-fast"])),
            "gen_length": gen,
            "block_length": W,
            **steps,
            "temperature": d(st.sampled_from([0.0, 0.9])),
            "threshold": d(st.sampled_from([1.0, 0.6])),
            "cfg_scale": 0.0 if editing else d(st.sampled_from([0.0, 0.0, 1.5])),
            "edit_threshold": d(st.sampled_from([0.5, 0.8])) if editing else 1.0,
            "min_tokens": d(st.integers(0, 4)),
            "presence_penalty": d(st.sampled_from([0.0, 0.0, 0.7])),
        }
        return {"prompt": d(st.sampled_from(PROMPTS)), "settings": row, "seed": d(st.integers(0, 999))}

    return draw()


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(_row(), min_size=3, max_size=6), late=st.integers(0, 2))
def test_random_mixes_answer_as_each_request_alone(engine: Engine, rows: list[dict[str, Any]], late: int) -> None:
    reqs = [_request(engine, k, r) for k, r in enumerate(rows)]
    net = Net(engine.model)
    running = _scheduler(engine, 3, net)
    waiting = reqs[len(reqs) - late :]
    got: dict[int, list[int]] = {}
    dropped = -1
    for key, ids, _ in running.run(reqs[: len(reqs) - late]):
        got[key] = ids
        in_flight = [k for k in running.in_flight_keys() if k != key]
        if dropped < 0 and in_flight:  # a row in flight, not yet answered, leaves and is never answered
            dropped = in_flight[0]
            running.drop([dropped])
        if waiting:  # rows joining while others run
            running.add([waiting.pop()])
    assert dropped not in got and sorted(got) == sorted(r.key for r in reqs if r.key != dropped)
    for r in reqs:
        if r.key != dropped:
            assert got[r.key] == _alone(engine, r), r.plan
    assert not running.lanes and not running.recomputing  # every cache given back, no row left behind


def test_rows_that_recompute_hold_no_cache_and_share_one_forward_a_round(engine: Engine) -> None:
    """Three `block` rows of two widths and three lengths in flight: one forward a round serves all of them
    (two under guidance: the unconditional views), and no lane (cache) is made; rows that recompute are one
    working state to the memory planner, whatever their widths."""
    widths = {"The cat": 4, "Once upon a time there was a small river": 8, "a": 8}
    reqs = [
        _request(
            engine, k, {"prompt": p, "settings": {"strategy": "block", "gen_length": 12, "block_length": W}, "seed": k}
        )
        for k, (p, W) in enumerate(widths.items())
    ]
    for guided in (False, True):
        if guided:
            reqs = [
                _request(
                    engine,
                    0,
                    {
                        "prompt": "The cat",
                        "seed": 0,
                        "settings": {"strategy": "block", "gen_length": 12, "cfg_scale": 1.5},
                    },
                )
            ] + reqs[1:]
        net = Net(engine.model)
        running = _scheduler(engine, 3, net)
        taken = {}
        for key, _, forwards in running.run(reqs):
            assert not running.lanes  # nothing cached
            taken[key] = forwards
        assert net.nfe == running.occupancy.forwards
        # each round: one packed forward of every row's prefix, and one of the guided row's unconditional view
        # (a guided row takes part in both: two forwards a round)
        rounds = {k: n // 2 if guided and k == 0 else n for k, n in taken.items()}
        assert net.nfe == max(rounds.values()) + (rounds[0] if guided else 0), (net.nfe, taken)
    lanes = {_lane_of(engine.params({"strategy": "block", "block_length": W})) for W in (4, 8, 16)}
    assert len(lanes) == 1
    assert _lane_of(engine.params({"strategy": "block-fast", "block_length": 8})) not in lanes


def test_the_engine_decodes_block_rows_in_the_running_set(engine: Engine) -> None:
    params = engine.params({"strategy": "block", "gen_length": 8, "temperature": 0.9, "seed": 3})
    assert engine.continuous(params)
    prompts = [engine.encode_prompt(p) for p in PROMPTS[:3]]
    together, _ = engine.decode_ids(prompts, params, seeds=[1, 2, 3])
    for i, p in enumerate(prompts):
        assert engine.decode_ids([p], params, seeds=[i + 1])[0] == [together[i]]


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_packed_block_causal_segment_is_the_models_own_block_causal_forward(
    engine: Engine, deterministic: bool
) -> None:
    """Rows of different lengths and block widths packed in one forward: each row's hidden states are those of
    the model's own forward of that row alone under the block-causal mask (query i sees key j when j // W <=
    i // W), written here."""
    model = engine.model
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 560, (n,), generator=gen) for n in (5, 16, 11, 16)]
    widths = [4, 8, 4, 4]
    n_layers = len(model.parts()[1])  # type: ignore[operator]
    with invariant.enabled(deterministic):
        packed, segments = packed_hidden(Net(model), rows, widths, n_layers, torch.device("cpu"))
        for ids, W, s in zip(rows, widths, segments):
            n = len(ids)
            q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
            mask = (k // W <= q // W)[None, None]  # (1, 1, n, n)
            alone, _ = model.hidden(ids[None], torch.arange(n)[None], mask, None, 0, False)
            assert torch.allclose(packed[s.begin : s.end], alone[0], atol=1e-5), (n, W)
            if deterministic:
                assert torch.equal(packed[s.begin : s.end], alone[0]), (n, W)
