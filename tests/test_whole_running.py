"""The running set of the whole-canvas samplers (`decode.wholerun`: LLaDA's reference decoder, Dream's and
RND1's own): random mixes of requests (prompts and answers of every length, blocks, steps, samplers, rankings,
guidance, seeds), some joining while others run and one dropped in flight, each answer equal to the same
request decoded alone; admission as rows finish takes fewer forwards than static batches. The samplers
themselves are pinned to their families' own code by the recorded cases of `test_llada_reference.py`,
`test_dream.py` and `test_rnd1_sampler.py`, which the engine now decodes through this set."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from celeris_cli import load_engine
from celeris_cli.decode.runset import RowRequest
from celeris_cli.decode.strategies import Net, plan_for
from celeris_cli.decode.wholerun import WholeScheduler

DATA = Path(__file__).parent / "data"
PROMPTS = ["The cat", "a", "Once upon a time there was a small river", "hi there", "床前明月光，"]


FOLDERS = {"rnd1": DATA / "rnd1" / "rnd1_tiny", "dream": DATA / "dream" / "dream_tiny", "reference": DATA / "llada_hf"}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def family(request: pytest.FixtureRequest) -> Any:
    name = request.param
    return name, load_engine(FOLDERS[name], device="cpu", dtype="float32")


def _settings(name: str, rng: random.Random) -> dict[str, Any]:
    gen = rng.choice([4, 7, 12])
    steps = rng.choice([1, 3, gen, gen + 2])
    sampler = {"temperature": rng.choice([0.0, 0.0, 0.8, 1.0])}
    if name == "reference":  # LLaDA's: blocks, remasking, guidance (a second view a row)
        extra: dict[str, Any] = {
            "block_length": rng.choice([gen, 4]),
            "remasking": rng.choice(["low_confidence", "random"]),
            "cfg_scale": rng.choice([0.0, 1.5]),
        }
        steps = min(steps, gen)  # every LLaDA step commits a token
    elif name == "rnd1":
        extra = {"top_k": rng.choice([0, 0, 5]), "eb_gamma": rng.choice([-1.0, -1.0, 0.5])}
    else:
        alg = rng.choice(["maskgit_plus", "topk_margin", "entropy", "origin"])
        drawn = 0.0 if alg == "origin" else rng.choice([0.0, 2.0])  # origin has no ranking to draw from
        extra = {"alg": alg, "alg_temp": drawn, "top_p": rng.choice([1.0, 0.9])}
    return {"strategy": name, "gen_length": gen, "denoise_steps": steps, **sampler, **extra}


def _request(engine: Any, key: int, settings: dict[str, Any], prompt: str, seed: int) -> RowRequest[Any]:
    ids = engine.encode_prompt(prompt)
    return RowRequest(key, ids, plan_for(engine.params(settings)), seed)


def _alone(engine: Any, req: RowRequest[Any]) -> list[int]:
    special = engine.special
    rows = WholeScheduler(Net(engine.model), special.mask_id, special.pad_id, 1, engine.device)
    [(_, ids, _)] = list(rows.run([req]))
    return ids


@pytest.mark.parametrize("trial", range(2))
def test_random_mixes_answer_as_each_request_alone(family: Any, trial: int) -> None:
    """Trial 1 computes the LM head a few positions at a time (`Net.chunk` 3): the rows' head calls split
    into groups (`WholeScheduler._head_groups`) where alone each row has one, and a row of more positions
    than that computes its own a chunk at a time."""
    name, engine = family
    rng = random.Random(f"{name}{trial}")
    reqs = [_request(engine, k, _settings(name, rng), rng.choice(PROMPTS), rng.randrange(1000)) for k in range(7)]
    special = engine.special
    net = Net(engine.model, chunk=3 if trial else None)
    sizes: list[int] = []  # positions per LM head call
    step_head = net.step_head

    def counted() -> Any:
        head = step_head()
        return lambda h: sizes.append(len(h)) or head(h)

    net.step_head = counted  # type: ignore[method-assign]
    rows = WholeScheduler(net, special.mask_id, special.pad_id, 3, engine.device)
    got, late, dropped = {}, reqs[5:], -1
    for key, ids, _ in rows.run(reqs[:5]):
        got[key] = ids
        if dropped < 0:  # a row in flight, not yet answered, leaves and is never answered
            dropped = next(k for k in rows.in_flight_keys() if k != key)
            rows.drop([dropped])
        if late:  # rows joining while others run
            rows.add([late.pop()])
    assert dropped not in got and sorted(got) == sorted(r.key for r in reqs if r.key != dropped)
    assert sizes and max(sizes) <= net.chunk  # no head call holds the logits of more than a chunk
    for r in reqs:
        if r.key != dropped:
            assert got[r.key] == _alone(engine, r), r.plan
    assert all(len(got[r.key]) == r.gen_length for r in reqs if r.key != dropped)


def test_rows_join_as_others_finish_in_fewer_forwards_than_static_batches(family: Any) -> None:
    name, engine = family
    long = {"strategy": name, "gen_length": 12, "denoise_steps": 12, "temperature": 0.0}
    short = {**long, "gen_length": 4, "denoise_steps": 2}
    reqs = [_request(engine, k, long if k == 0 else short, PROMPTS[k], k) for k in range(4)]
    forwards, taken = {}, {}
    for refill in (True, False):
        special = engine.special
        net = Net(engine.model)
        rows = WholeScheduler(net, special.mask_id, special.pad_id, 2, engine.device, refill=refill)
        answers = {}
        for key, ids, n in rows.run(reqs):
            answers[key], taken[key] = ids, n
        assert answers == {r.key: _alone(engine, r) for r in reqs}
        forwards[refill] = net.nfe
    # continuous: the long row's forwards carry the three short rows beside it, one after another; static:
    # [long, short], then [short, short]
    assert sum(taken[k] for k in (1, 2, 3)) <= taken[0] and taken[3] < taken[0]
    assert forwards[True] == taken[0] and forwards[False] == taken[0] + taken[3]


def test_the_engine_decodes_its_rows_in_the_running_set(family: Any) -> None:
    name, engine = family
    params = engine.params({"strategy": name, "gen_length": 6, "denoise_steps": 3})
    assert engine.continuous(params)
    results = engine.generate(PROMPTS[:3], params, batch_size=2)
    assert engine.last_occupancy is not None and engine.last_occupancy.forwards > 0
    assert len(results) == 3 and all(r.output_tokens <= 6 for r in results)


def test_a_memory_budget_counts_whole_rows_as_one_working_state_whatever_their_blocks() -> None:
    """The whole-canvas rows keep no cache, so rows of two block lengths are not two lanes' caches: under a
    budget the set is as wide for them as for rows of one block length (the planner once halved it)."""
    engine = load_engine(FOLDERS["reference"], device="cpu", dtype="float32", max_memory="1TiB")
    eight, sixteen = (
        engine.params({"strategy": "reference", "gen_length": 16, "block_length": w, "denoise_steps": 16})
        for w in (8, 16)
    )
    encoded = [engine.encode_prompt(p) for p in PROMPTS * 2]
    engine.memory.budget = engine.memory.need([max(encoded, key=len)] * 4, eight)  # about four rows
    one = engine._running_width(encoded, [eight] * len(encoded), 8)
    assert 1 < one < 8 and engine._running_width(encoded, [eight, sixteen] * (len(encoded) // 2), 8) == one
