"""What every kind of running set owes its rows (`decode.runset`, fed by `engine.LiveRun`): widened under a
memory budget while rows of different lengths are in flight, the rows that join get slots of their own and
answer as they do alone; out of memory, the blame lands on the row that failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celeris_cli import load_engine
from celeris_cli.engine import Engine
from celeris_cli.errors import TooLarge

from .conftest import decoded_alone, make_model

SHORT = ["a", "the cat", "床前", "hi", "白日"]
LONG = "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。床前明月光，疑是地上霜。举头望明月，低头思故乡。" * 6

KINDS = {  # the settings of each kind of row (`engine._running_kind`), with every row's block in one lane
    "block": {"strategy": "block-fast", "gen_length": 16, "block_length": 8},
    "waves": {"strategy": "fast", "gen_length": 16, "block_length": 8, "early_exit": False},
    "guided": {"strategy": "block-fast", "gen_length": 16, "block_length": 8, "cfg_scale": 1.5},  # two slots a row
    "seeded": {"strategy": "nemotron", "gen_length": 16, "block_length": 8},  # Nemotron's diffusion mode
    "whole": {"strategy": "reference", "gen_length": 16, "block_length": 8, "denoise_steps": 8},  # no cache
    "recomputed": {"strategy": "block", "gen_length": 16, "block_length": 8},  # block rows with no cache
}
NEMOTRON = Path(__file__).parent / "data" / "nemotron" / "nemotron_tiny"


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Any:
    kind = request.param
    if kind == "seeded":
        return kind, load_engine(NEMOTRON, device="cpu", dtype="float32")
    bidirectional = kind in ("waves", "whole")
    folder = make_model(tmp_path_factory.mktemp(kind) / "m", tiny_tokenizer, seed=5, block_causal=not bidirectional)
    return kind, load_engine(folder, device="cpu", dtype="float32")


def _text(engine: Engine, prompt: str, params: Any, seed: int) -> str:
    return engine.finish(decoded_alone(engine, prompt, params, seed), params.stop, engine.encode_prompt(prompt))[0]


def test_a_running_set_widened_under_a_budget_gives_every_joining_row_a_slot(kind_engine: Any) -> None:
    """A long row and a short one under a budget that fits one long row: one row runs at a time. Once the
    long row is answered, three short rows join and the planner widens the set while the first short row is
    in flight: the new rows need slots the set did not have (the bidirectional kind wrote past its cache)."""
    kind, engine = kind_engine
    params = engine.params({**KINDS[kind], "temperature": 1.0})
    long_ids = engine.encode_prompt(LONG)
    engine.memory.budget = engine.memory.need([long_ids], params)
    try:
        live = engine.live(max_batch=4)
        live.add(0, LONG, long_ids, params, 0)
        live.add(1, SHORT[0], engine.encode_prompt(SHORT[0]), params, 1)
        assert live.width == 1
        got, widths = {}, []
        for key, result in live.answers():
            got[key] = result
            if key == 0:  # the first answer: the long row
                for k in (2, 3, 4):
                    live.add(k, SHORT[k - 1], engine.encode_prompt(SHORT[k - 1]), params, k)
                widths.append(live.width)
    finally:
        engine.memory.budget = None
    assert widths and widths[0] > 1  # the set widened with rows in flight
    prompts = [LONG, *SHORT[:4]]
    assert {k: r.text for k, r in got.items()} == {k: _text(engine, p, params, k) for k, p in enumerate(prompts)}


class _OutOfMemoryWhenArmed:
    """The model, except that once armed a forward over more than one row runs out of memory."""

    def __init__(self, model: Any) -> None:
        self.model, self.armed = model, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def hidden(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.armed and ids.shape[0] > 1:
            raise torch.OutOfMemoryError("fake: several rows")
        return self.model.hidden(ids, *args, **kwargs)


def test_out_of_memory_with_several_rows_in_flight_narrows_and_blames_no_row(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path
) -> None:
    """The planner narrows the set to one row while three are in flight (a long row arrives); the next
    forward of the three runs out of memory. No row ran alone, so none is blamed: the three go on one at a
    time and every row is answered as alone (before, the first row in dict order was failed)."""
    folder = make_model(tmp_path_factory.mktemp("blame") / "m", tiny_tokenizer, seed=5, block_causal=True)
    engine = load_engine(folder, device="cpu", dtype="float32")
    params = engine.params({**KINDS["block"], "temperature": 1.0})
    fake = _OutOfMemoryWhenArmed(engine.model)
    engine.model = fake  # type: ignore[assignment]
    long_ids = engine.encode_prompt(LONG)
    live = engine.live(max_batch=4)
    arrived: list[int] = []

    def long_row_arrives(key: int, ids: list[int]) -> None:  # as the first block is committed, mid-round
        if not arrived:
            arrived.append(live.scheduler.in_flight)  # type: ignore[union-attr]
            engine.memory.budget = engine.memory.need([long_ids], params)  # one long row, or three short ones
            live.add(3, LONG, long_ids, params, 3)
            fake.armed = True

    live.on_block = long_row_arrives
    for k in range(3):
        live.add(k, SHORT[k], engine.encode_prompt(SHORT[k]), params, k)
    try:
        got = dict(live.answers())
    finally:
        engine.memory.budget = None
    assert arrived == [3] and live.width == 1
    assert not [k for k, r in got.items() if isinstance(r, TooLarge)]
    prompts = [*SHORT[:3], LONG]
    engine.model = fake.model  # type: ignore[assignment]
    assert {k: r.text for k, r in got.items()} == {k: _text(engine, p, params, k) for k, p in enumerate(prompts)}


def test_a_row_cancelled_in_flight_leaves_as_the_next_round_begins(kind_engine: Any) -> None:
    """A caller that no longer wants a row (a client that hung up) cancels it from `before_round`: the row
    leaves its running set at once, its slot freed, and is never answered; its batch mate answers as alone."""
    kind, engine = kind_engine
    params = engine.params({**KINDS[kind], "temperature": 1.0})
    live = engine.live(max_batch=2)
    seen: list[list[int]] = []

    def hook() -> None:
        seen.append(sorted(live.scheduler.in_flight_keys()))  # type: ignore[union-attr]
        if len(seen) == 3:
            live.cancel(0)

    live.before_round = hook
    live.add(0, LONG, engine.encode_prompt(LONG), params, 0)
    live.add(1, SHORT[1], engine.encode_prompt(SHORT[1]), params, 1)
    live.add(2, SHORT[2], engine.encode_prompt(SHORT[2]), params, 2)  # waiting: it takes the freed place
    got = dict(live.answers())
    assert seen[2] == [0, 1] and all(0 not in keys for keys in seen[3:])
    assert sorted(got) == [1, 2] and not live.pending
    assert {k: r.text for k, r in got.items()} == {k: _text(engine, SHORT[k], params, k) for k in (1, 2)}  # type: ignore[union-attr]


def test_cancelling_the_last_row_in_flight_ends_the_run_cleanly(kind_engine: Any) -> None:
    kind, engine = kind_engine
    params = engine.params({**KINDS[kind], "temperature": 1.0})
    live = engine.live(max_batch=2)
    rounds: list[int] = []

    def hook() -> None:
        rounds.append(1)
        if len(rounds) == 2:
            live.cancel(0)

    live.before_round = hook
    live.add(0, LONG, engine.encode_prompt(LONG), params, 0)
    assert dict(live.answers()) == {} and not live.pending


def test_rows_of_two_kinds_share_one_live_run_and_answer_as_alone(engine: Engine) -> None:
    """The fast decoder's rows (waves) and the reference decoder's (whole canvases) added to one `LiveRun`: each
    kind runs in its own set inside it (`KindSet`), both in flight in the same rounds, never more rows in
    flight in all than the width, a kind whose rows have all left gives its caches back while the other runs,
    and every answer is its request's alone."""
    fast = engine.params({"strategy": "fast", "gen_length": 16, "block_length": 8, "temperature": 1.0, "cache": "dual"})
    ref = engine.params({**KINDS["whole"], "temperature": 1.0})
    live = engine.live(max_batch=3)
    in_flight: list[dict[str, int]] = []

    idle: list[int] = []  # the waves set's lanes at rounds where none of its rows waits or runs

    def hook() -> None:
        kinds = live.scheduler.kinds  # type: ignore[union-attr]
        in_flight.append({name: s.in_flight for name, s in kinds.items() if s.in_flight})
        waves = kinds.get("waves")
        if waves is not None and not (waves.waiting or waves.in_flight):
            idle.append(len(waves.lanes))

    live.before_round = hook
    rows = [(p, fast if i % 2 else ref, i) for i, p in enumerate([LONG, *SHORT])]
    for key, (p, q, seed) in enumerate(rows):
        assert live.accepts(q)
        live.add(key, p, engine.encode_prompt(p), q, seed)
    got = dict(live.answers())
    assert live.kinds == {"waves", "whole"}
    assert any(len(kinds) == 2 for kinds in in_flight)  # both kinds in one round
    assert max(sum(kinds.values()) for kinds in in_flight) == 3  # the width, over the kinds together
    assert idle and not any(idle)  # a kind whose rows have all left holds no cache while the others run
    assert {k: r.text for k, r in got.items()} == {k: _text(engine, p, q, s) for k, (p, q, s) in enumerate(rows)}  # type: ignore[union-attr]


@st.composite
def _mixed_row(draw: st.DrawFn) -> tuple[str, dict[str, Any], int]:
    gen = draw(st.sampled_from([8, 16]))
    settings = {
        "strategy": draw(st.sampled_from(["fast", "reference"])),
        "gen_length": gen,
        "block_length": draw(st.sampled_from([4, 8])),
        "denoise_steps": draw(st.sampled_from([gen // 2, gen])),
        "temperature": draw(st.sampled_from([0.0, 1.0])),
    }
    return draw(st.sampled_from([LONG[:40], *SHORT])), settings, draw(st.integers(0, 99))


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(_mixed_row(), min_size=3, max_size=6), later=st.integers(0, 3), cancel=st.booleans())
def test_drawn_mixes_of_kinds_answer_as_alone_with_rows_joining_and_one_cancelled(
    engine: Engine, rows: list[tuple[str, dict[str, Any], int]], later: int, cancel: bool
) -> None:
    """Rows of two kinds (waves, whole canvases) drawn at random into one `LiveRun` of width 2: some added before
    it runs, the rest as answers come back, one cancelled in flight (from `before_round`, as serve does); every
    other row answers as its request alone."""
    params = [(p, engine.params(s), seed) for p, s, seed in rows]
    live = engine.live(max_batch=2)
    cancelled: list[int] = []

    def hook() -> None:
        flying = sorted(live.scheduler.in_flight_keys())  # type: ignore[union-attr]
        if cancel and not cancelled and flying:
            cancelled.append(flying[-1])
            live.cancel(flying[-1])

    live.before_round = hook
    first = max(1, len(params) - later)
    for key, (p, q, seed) in enumerate(params[:first]):
        live.add(key, p, engine.encode_prompt(p), q, seed)
    added, got = first, {}
    for key, result in live.answers():
        got[key] = result.text  # type: ignore[union-attr]
        if added < len(params):
            p, q, seed = params[added]
            live.add(added, p, engine.encode_prompt(p), q, seed)
            added += 1
    assert sorted(got) == [k for k in range(len(params)) if k not in cancelled]
    assert got == {k: _text(engine, *params[k]) for k in got}
