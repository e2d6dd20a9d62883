"""The running set of self-speculative decoding (`decode.specrun`): rows join as others leave, each at its own
place in its own slot, in lanes by settings, and every answer is its request's alone, which is its AR
answer: however wide the set, whoever ran beside it, whether rounds drafted, and whether rows beside it
were dropped in flight."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celeris_cli import load_engine
from celeris_cli.decode.runset import KindSet
from celeris_cli.engine import LiveRun

PROMPTS = ["The old man", "It was late", "床前明月光，", "The river", "At night", "She opened the door", "白日依山尽，"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    engine = load_engine(None, device="cpu", dtype="float32")  # the default model, decoded by its `spec`
    assert engine.model_dir is not None
    config = json.loads((engine.model_dir / "generation_config.json").read_text(encoding="utf-8"))
    return engine.with_defaults({**config, "strategy": "spec"})


def _rows(engine: Any, drafting: str) -> tuple[list[str], list[Any], list[int]]:
    """Requests of three lengths and two samplers (so two lanes, and rows that leave at different rounds), each
    with the settings its prompt runs with (the script presets: more lanes)."""
    prompts, params, seeds = [], [], []
    for i in range(10):
        p = PROMPTS[i % len(PROMPTS)]
        layer = {"gen_length": (8, 20, 33)[i % 3], "temperature": (0.0, 0.9)[i % 2], "drafting": drafting}
        prompts.append(p)
        params.append(engine.params_for(p, engine.params({**layer, "denoise_steps": 4})))
        seeds.append(100 + i)
    return prompts, params, seeds


def _alone(engine: Any, prompts: list[str], params: list[Any], seeds: list[int]) -> list[str]:
    """Each request in a static batch of its own (the static decoder, `generate_self_spec`)."""
    one = [
        engine.decode_batch([p], [engine.encode_prompt(p)], q, [s], presets=False)[0]
        for p, q, s in zip(prompts, params, seeds)
    ]
    return [r.text for r in one]


@pytest.mark.parametrize("drafting", ["always", "never", "auto"])
def test_rows_that_join_as_others_leave_answer_as_alone(engine, drafting) -> None:  # type: ignore[no-untyped-def]
    prompts, params, seeds = _rows(engine, drafting)
    encoded = [engine.encode_prompt(p) for p in prompts]
    want = _alone(engine, prompts, params, seeds)
    before = engine.drafted
    got = engine.decode_running(prompts, encoded, params, seeds, 3)
    assert [r.text for r in got] == want
    if drafting != "auto":  # auto: width 3 on this CPU may go either way
        assert (engine.drafted > before) == (drafting == "always")
    refilled = engine.last_occupancy
    assert refilled is not None and refilled.prefills <= len(prompts)  # rows joining one round prefill together
    static = engine.decode_running(prompts, encoded, params, seeds, 3, refill=False)
    assert [r.text for r in static] == want
    # rows joined as others left: more rows in flight per round than static batches of three keep
    assert refilled.mean_in_flight > engine.last_occupancy.mean_in_flight


def test_rows_of_different_draft_widths_share_one_forward_a_round(engine) -> None:  # type: ignore[no-untyped-def]
    """Draft widths 2 to 12 (gen_length over denoise_steps) in one lane: one forward a round, each row drafting
    its own width's masks, every answer its own alone."""
    prompts = ["The old man", "It was late", "The river", "At night", "She opened the door", "Rain fell on"]
    params = [
        engine.params_for(p, engine.params({"gen_length": 24, "denoise_steps": s, "drafting": "always"}))
        for p, s in zip(prompts, (12, 6, 4, 3, 2, 8))
    ]
    assert sorted({p.part("drafting").width for p in params}) == [2, 3, 4, 6, 8, 12]
    seeds = list(range(len(prompts)))
    before = engine.drafted
    got = engine.decode_running(prompts, [engine.encode_prompt(p) for p in prompts], params, seeds, 4)
    occupancy, drafted = engine.last_occupancy, engine.drafted - before
    assert occupancy is not None and occupancy.forwards == occupancy.rounds  # one lane
    before = engine.drafted
    assert [r.text for r in got] == _alone(engine, prompts, params, seeds)
    # a row's drafts are its own width's masks' guesses: it drafts in the lane as it does alone
    assert drafted == engine.drafted - before > 0


def test_the_ar_strategy_and_spec_in_the_running_set_give_the_same_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    prompts = PROMPTS * 2
    seeds = list(range(len(prompts)))
    spec = engine.params({"gen_length": 24, "temperature": 0.8, "drafting": "always", "denoise_steps": 6})
    ar = engine.params({"strategy": "ar", "gen_length": 24, "temperature": 0.8})
    assert engine.continuous(spec) and not engine.continuous(ar)  # the AR yardstick stays in static batches
    got = [r.text for r in engine.generate(prompts, spec, batch_size=4, seeds=seeds)]
    assert got == [r.text for r in engine.generate(prompts, ar, batch_size=4, seeds=seeds)]


def test_a_row_dropped_in_flight_leaves_the_others_answers_as_alone(engine) -> None:  # type: ignore[no-untyped-def]
    prompts, params, seeds = _rows(engine, "always")
    want = _alone(engine, prompts, params, seeds)
    live = LiveRun(engine, 4)
    rounds = [0]

    def before_round() -> None:
        rounds[0] += 1
        if rounds[0] == 6:  # rows 0 and 2 are in flight (the longest answers first): 0 leaves mid-answer
            live.cancel(0)

    live.before_round = before_round
    for i, (p, q, s) in enumerate(zip(prompts, params, seeds)):
        live.add(i, p, engine.encode_prompt(p), q, s)
    got = {key: r.text for key, r in live.answers()}
    assert 0 not in got and got == {i: want[i] for i in range(1, len(prompts))}


def test_a_constrained_row_in_the_running_set_follows_its_grammar_as_alone(engine) -> None:  # type: ignore[no-untyped-def]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    layer = {"gen_length": 40, "structured_outputs": json.dumps({"json": schema}), "drafting": "always"}
    constrained = engine.params({**layer, "denoise_steps": 8})
    plain = engine.params({"gen_length": 40, "drafting": "always", "denoise_steps": 8})
    prompts = ["Extract the person: Ada, 36.", "The river", "Extract the person: Alan.", "At night"]
    params = [constrained, plain, constrained, plain]
    seeds = [1, 2, 3, 4]
    got = engine.decode_running(prompts, [engine.encode_prompt(p) for p in prompts], params, seeds, 2)
    assert [r.text for r in got] == _alone(engine, prompts, params, seeds)
    for r in (got[0], got[2]):
        if r.finish_reason == "stop":
            assert set(json.loads(r.text)) == {"name"}


def test_the_hook_sees_each_rows_decided_ids_grow_to_its_answer(engine) -> None:  # type: ignore[no-untyped-def]
    """What `serve` streams: after each round that added to a row, its answer so far; its whole answer as it
    leaves. Decided tokens never change, so each report extends the one before, and the hook only reads."""
    params = engine.params({"gen_length": 24, "temperature": 0.9, "drafting": "always", "denoise_steps": 6})
    prompts = [engine.encode_prompt(p) for p in ("The old man", "床前明月光，")]
    seen: dict[int, list[list[int]]] = {0: [], 1: []}
    hooked, _ = engine.decode_ids(prompts, params, [4, 5], on_block=lambda b, ids: seen[b].append(ids))
    plain, _ = engine.decode_ids(prompts, params, [4, 5])
    assert hooked == plain
    for b in (0, 1):
        grown = seen[b]
        assert len(grown) > 2 and all(a == c[: len(a)] and len(a) < len(c) for a, c in zip(grown, grown[1:]))
        assert grown[-1] == plain[b] and engine.special.mask_id not in grown[-2]


def test_a_live_run_streams_spec_rows_as_serve_reads_them(engine) -> None:  # type: ignore[no-untyped-def]
    """`serve` sets the live run's `on_block`: a spec row's decided ids reach it as they grow, the last its
    answer, while rows join and leave beside it."""
    prompts, params, seeds = _rows(engine, "always")
    live = LiveRun(engine, 3)
    seen: dict[int, list[list[int]]] = {}
    live.on_block = lambda key, ids: seen.setdefault(key, []).append(ids)
    for i, (p, q, s) in enumerate(zip(prompts, params, seeds)):
        live.add(i, p, engine.encode_prompt(p), q, s)
    got = dict(live.answers())
    assert sorted(seen) == sorted(got) == list(range(len(prompts)))
    for key, grown in seen.items():
        assert all(a == c[: len(a)] and len(a) < len(c) for a, c in zip(grown, grown[1:]))
        assert engine.finish(grown[-1], (), engine.encode_prompt(prompts[key]))[0] == got[key].text


def test_rows_give_their_slots_back_and_every_lane_its_cache(engine) -> None:  # type: ignore[no-untyped-def]
    """Ten rows through a set of three: no forward holds more rows than the set is wide (a row that left gave
    its slot back), and once every row is answered no lane is left holding a cache."""
    prompts, params, seeds = _rows(engine, "never")
    live = engine.live(max_batch=3)
    for i, (p, q, s) in enumerate(zip(prompts, params, seeds)):
        live.add(i, p, engine.encode_prompt(p), q, s)
    assert sorted(key for key, _ in live.answers()) == list(range(10))
    scheduler = live.scheduler
    assert isinstance(scheduler, KindSet) and list(scheduler.kinds) == ["spec"]
    assert not scheduler.kinds["spec"].lanes  # type: ignore[attr-defined]
    occupancy = scheduler.occupancy
    assert occupancy.forwards > 0 and occupancy.rows <= 3 * occupancy.forwards


IDLE_CASES = {  # the kind whose short rows leave first, and the settings of both kinds' rows
    "seeded": (
        {"strategy": "nemotron", "gen_length": 8, "temperature": 1.0},
        {"strategy": "spec", "gen_length": 32, "min_tokens": 32, "drafting": "never"},
    ),
    "spec": (
        {"strategy": "spec", "gen_length": 6, "drafting": "always", "temperature": 1.0},
        {"strategy": "nemotron", "gen_length": 48, "min_tokens": 48, "temperature": 1.0},
    ),
}


@pytest.mark.parametrize("kind", sorted(IDLE_CASES))
def test_a_kind_whose_rows_have_all_left_gives_its_caches_back_while_another_kind_runs(engine, kind) -> None:  # type: ignore[no-untyped-def]
    """Short rows of one kind beside long rows of the other in one `LiveRun` (`KindSet`): once every short row
    has been answered, its kind's set holds no lane while the long rows go on. The seeded set's lanes were
    given back only as its next round began, which never comes while it has no rows; a spec lane's finished
    rows ride along until it compacts."""
    live = engine.live(max_batch=4)
    short, long = (engine.params(s) for s in IDLE_CASES[kind])
    idle: list[int] = []

    def hook() -> None:
        done = live.scheduler.kinds.get(kind)  # type: ignore[union-attr]
        if done is not None and not (done.waiting or done.in_flight) and live.scheduler.in_flight:  # type: ignore[union-attr]
            idle.append(len(done.lanes))

    live.before_round = hook
    rows = [("The old man", short), ("It was late", short), ("The river", long), ("At night", long)]
    for key, (p, q) in enumerate(rows):
        live.add(key, p, engine.encode_prompt(p), q, key)
    assert sorted(k for k, _ in live.answers()) == [0, 1, 2, 3]
    assert idle and not any(idle)


def test_a_spec_lane_never_holds_more_slots_than_the_width_when_rows_wait_in_the_kind_set(engine) -> None:  # type: ignore[no-untyped-def]
    """Ten rows of different lengths through a `LiveRun` of width 8 (one finished row of 8 is under the quarter
    that compacts a lane): the requests wait in the `KindSet`, not in
    the spec set, so a lane's finished rows (which ride along while nothing waits there) leave before new rows
    join, and no cache is grown past the width."""
    prompts, params, seeds = _rows(engine, "always")
    live = engine.live(max_batch=8)
    slots: list[int] = []

    def hook() -> None:
        spec = live.scheduler.kinds.get("spec")  # type: ignore[union-attr]
        if spec is not None:
            slots.extend(lane.cache.rows for lane in spec.lanes.values() if lane.cache is not None)

    live.before_round = hook
    for i, (p, q, s) in enumerate(zip(prompts, params, seeds)):
        live.add(i, p, engine.encode_prompt(p), q, s)
    assert sorted(key for key, _ in live.answers()) == list(range(len(prompts)))
    assert slots and max(slots) <= 8
