"""Nemotron's diffusion mode (the default model's strategy) in its running set (`decode.seededrun`).

The oracle is a plain loop written here from the family's `generate` as `decode.nemotron` describes it: the
whole sequence recomputed by the model at every forward (no cache, no running set, no slot, no padding; the
causal prefix and the bidirectional block in one mask), the schedule and the commit rule written out again.
Greedy answers must equal it token for token. Sampled answers must not depend on batch mates, on when a row
joined, on a row that left in flight, or on the running set's width (rule 2).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.decode.runset import RowRequest
from celeris_cli.decode.sampling import request_seed
from celeris_cli.decode.seededrun import SeededScheduler
from celeris_cli.decode.strategies import Net, plan_for
from celeris_cli.engine import Engine

NEMOTRON = Path(__file__).parent / "data" / "nemotron" / "nemotron_tiny"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(NEMOTRON, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def default_engine() -> Engine:
    return load_engine(None, device="cpu", dtype="float32")


def _plain_loop(engine: Engine, prompt: list[int], G: int, W: int, steps: int) -> list[int]:
    """The diffusion mode at temperature 0, low-confidence order, no threshold, recomputing everything."""
    model, mask_id = engine.model, engine.special.mask_id
    stop = set(engine.special.stop_ids)
    with torch.no_grad():
        h, _ = model.hidden(torch.zeros(1, 1, dtype=torch.long), None, None)
        width = model.step_head()(h[0]).shape[-1]  # the ids the tokenizer can decode

    def logits(seq: list[int], block_from: int) -> torch.Tensor:
        """Every position's logits: causal before `block_from`, the block from there sees all of itself."""
        T = len(seq)
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        mask = (k <= q) | ((q >= block_from) & (k >= block_from))
        with torch.no_grad():
            return model(torch.tensor([seq]), mask[None, None])[0, :, :width]

    def stopped(answer: list[int]) -> bool:  # a stop token with nothing masked before it
        for t in answer:
            if t == mask_id:
                return False
            if t in stop:
                return True
        return False

    x, P = list(prompt), len(prompt)
    seed = int(logits(x, len(x))[-1].argmax())
    for s in range(P, P + G, W):
        e = min(s + W, P + G)
        block = [seed] + [mask_id] * (e - s - 1)
        n = min(steps, e - s - 1)
        shares = [(e - s - 1) // n + (1 if i < (e - s - 1) % n else 0) for i in range(n)] if n else []
        for k in shares:
            if stopped(x[P:] + block) or mask_id not in block:
                break
            probs = logits(x + block, s)[s:e].softmax(-1)
            conf, tok = probs.max(-1)
            masked = [c for c in range(e - s) if block[c] == mask_id]
            for c in sorted(masked, key=lambda c: (-float(conf[c]), c))[:k]:
                block[c] = int(tok[c])
        x += block
        if stopped(x[P:]) or e == P + G:
            break
        seed = int(logits(x, len(x))[-1].argmax())  # the commit pass: the block causally, then its next token
    answer = x[P:] + [mask_id] * (P + G - len(x))
    for i, t in enumerate(answer):
        if t in stop:
            return answer[: i + 1] + [t] * (G - i - 1)
    return answer


@pytest.mark.parametrize(("G", "W", "steps"), [(12, 4, 3), (10, 4, 2), (9, 3, 1), (7, 1, 1)])
def test_greedy_answers_equal_a_plain_loop_with_no_cache(engine: Engine, G: int, W: int, steps: int) -> None:
    prompts = [engine.encode_prompt(t) for t in ("hello there", "the cat", "床前明月光，", "a b c d e f")]
    params = engine.params(
        {"strategy": "nemotron", "gen_length": G, "block_length": W, "block_steps": steps, "temperature": 0.0}
    )
    together, _ = engine.decode_ids(prompts, params)  # one running set of four rows
    assert together == [_plain_loop(engine, p, G, W, steps) for p in prompts]


def test_the_default_models_greedy_answer_equals_the_plain_loop(default_engine: Engine) -> None:
    """The default model, its last block shorter than the rest (gen 20 in blocks of 8)."""
    prompts = [default_engine.encode_prompt(t) for t in ("床前明月光，", "The river runs")]
    params = default_engine.params(
        {"strategy": "nemotron", "gen_length": 20, "block_length": 8, "block_steps": 4, "temperature": 0.0, "min_p": 0}
    )  # (its min_p would rank by the filtered distribution's probability: the family's ranks by the softmax)
    together, _ = default_engine.decode_ids(prompts, params)
    assert together == [_plain_loop(default_engine, p, 20, 8, 4) for p in prompts]


def _requests(engine: Engine, n: int, rng: random.Random) -> list[RowRequest]:  # type: ignore[type-arg]
    """Random real-shaped requests: prompts, answer lengths, block widths, steps, samplers, orders,
    thresholds, shaping and seeds of their own."""
    texts = ["床前明月光，", "The quick brown fox", "Once upon a time", "hi", "春眠不觉晓，处处闻啼鸟。", "a b"]
    out = []
    while len(out) < n:
        W = rng.choice([2, 4, 8])
        settings = {
            "strategy": "nemotron",
            "gen_length": rng.choice([W, 9, 16, 23]),
            "block_length": W,
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "min_p": rng.choice([0.0, 0.05]),
            "remasking": rng.choice(["low_confidence", "random"]),
            "threshold": rng.choice([1.0, 0.4]),
        }
        if rng.random() < 0.5:
            settings["block_steps"] = rng.randint(1, 4)
        else:
            settings["denoise_steps"] = rng.randint(1, settings["gen_length"])
        if rng.random() < 0.4:
            settings.update(presence_penalty=1.3, min_tokens=3)
        ids = engine.encode_prompt(rng.choice(texts))
        seed = rng.randint(0, 1000)
        out.append(RowRequest(len(out), ids, plan_for(engine.params(settings)), request_seed(seed, ids)))
    return out


def _scheduler(engine: Engine, width: int, refill: bool = True) -> SeededScheduler:
    s = engine.special
    return SeededScheduler(Net(engine.model), s.mask_id, s.stop_ids, s.pad_id, width, engine.device, refill=refill)


def _alone(engine: Engine, req: RowRequest) -> list[int]:  # type: ignore[type-arg]
    [(_, ids, _)] = list(_scheduler(engine, 1).run([req]))
    return ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mixes_answer_as_each_request_alone(engine: Engine, seed: int) -> None:
    """Rows of every length, width, sampler and order, joining as others finish and added while the set runs,
    and one row dropped in flight: every other answer is its answer alone, at widths 3 and 5."""
    rng = random.Random(seed)
    reqs = _requests(engine, 10, rng)
    alone = {r.key: _alone(engine, r) for r in reqs}
    for width in (3, 5):
        scheduler = _scheduler(engine, width)
        got: dict[int, list[int]] = {}
        rows = scheduler.run(reqs[:6])
        dropped = reqs[1].key
        for i, (key, ids, _) in enumerate(rows):
            got[key] = ids
            if i == 0:
                scheduler.add(reqs[6:])  # arriving while the others decode
                scheduler.drop([dropped])
        assert dropped not in got or got[dropped] == alone[dropped]
        assert {k: v for k, v in got.items() if k != dropped} == {k: v for k, v in alone.items() if k != dropped}
        assert not any(lane.rows for lane in scheduler.lanes.values())


def test_a_row_whose_seed_ends_its_answer_leaves_without_a_step(engine: Engine) -> None:
    """A one-token answer is its seed alone: the prefill (both rows' in one forward), nothing after it."""
    params = engine.params({"strategy": "nemotron", "gen_length": 1, "block_length": 1, "temperature": 0.0})
    ar = engine.params({"strategy": "ar", "gen_length": 1, "temperature": 0.0})
    prompts = [engine.encode_prompt(t) for t in ("hello", "the cat sat")]
    out, nfe = engine.decode_ids(prompts, params)
    assert out == engine.decode_ids(prompts, ar)[0] and nfe == 1


def test_the_running_set_pays_back_its_slots(engine: Engine) -> None:
    """Rows leave their slots as they finish: nothing stays in a lane once every row is answered. Rows that
    join run their prompts in the round's one forward, beside the others' windows: none takes a forward
    of its own."""
    reqs = _requests(engine, 6, random.Random(7))
    scheduler = _scheduler(engine, 2)
    answered = [key for key, _, _ in scheduler.run(reqs)]
    assert sorted(answered) == list(range(6))
    assert all(not lane.rows for lane in scheduler.lanes.values())
    assert scheduler.occupancy.prefills == 0 and scheduler.occupancy.forwards == scheduler.occupancy.rounds


def test_each_draw_is_keyed_by_its_rows_block_then_step(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/determinism.md's key: (row seed, block, step), a block's seed at step 0 and its denoising steps
    at 1, 2, ...; no two draws of a row share a key."""
    import celeris_cli.decode.seededrun as seededrun
    from celeris_cli.decode.sampling import Draws, stream_seed

    keys: list[int] = []

    def recording(seeds: list[int], device: torch.device) -> Draws:
        keys.extend(seeds)
        return Draws(seeds, device)

    monkeypatch.setattr(seededrun, "Draws", recording)
    ids = engine.encode_prompt("the cat")
    params = engine.params(
        {"strategy": "nemotron", "gen_length": 12, "block_length": 4, "block_steps": 2, "temperature": 1.0}
    )
    req = RowRequest(0, ids, plan_for(params), request_seed(5, ids))
    [(_, answer, _)] = list(_scheduler(engine, 1).run([req]))
    assert 2 not in answer and 5 not in answer  # no early stop: every block decoded
    assert keys == [stream_seed(req.seed, j, i) for j in range(3) for i in range(3)]


def test_each_completed_block_is_streamed_and_the_blocks_add_up_to_the_answer(default_engine: Engine) -> None:
    """What `serve` streams (`LiveRun.on_block`): a row's ids so far as each of its blocks is complete, one
    block longer each time, the last the answer itself (up to its stop)."""
    e = default_engine
    params = e.params({"gen_length": 40, "block_length": 8, "denoise_steps": 10, "min_tokens": 30})
    live = e.live(max_batch=2)
    streamed: dict[int, list[list[int]]] = {}
    live.on_block = lambda key, ids: streamed.setdefault(key, []).append(ids)
    prompts = ["床前明月光，", "The river runs", "春眠不觉晓，"]
    for k, p in enumerate(prompts):
        live.add(k, p, e.encode_prompt(p), params, k)
    answers = dict(live.answers())
    for k, chunks in streamed.items():
        assert [len(c) for c in chunks] == [8 * (i + 1) for i in range(len(chunks) - 1)] + [len(chunks[-1])]
        assert all(later[: len(earlier)] == earlier for earlier, later in zip(chunks, chunks[1:]))
        assert e.finish(chunks[-1], prompt=e.encode_prompt(prompts[k]))[0] == answers[k].text
    assert sorted(streamed) == [0, 1, 2] and all(len(c) >= 4 for c in streamed.values())


def test_a_lane_whose_rows_have_all_left_gives_its_cache_back(engine: Engine) -> None:
    """Two block widths: once the short answers of width 2 are handed back, only the width-8 lane holds a
    cache while its long row runs on; none once the run is over."""
    ids = engine.encode_prompt("The cat")
    long = plan_for(engine.params({"strategy": "nemotron", "gen_length": 32, "block_length": 8}))
    short = plan_for(engine.params({"strategy": "nemotron", "gen_length": 2, "block_length": 2}))
    reqs = [RowRequest(0, ids, long, request_seed(0, ids))]
    reqs += [RowRequest(k, ids, short, request_seed(k, ids)) for k in (1, 2)]
    scheduler = _scheduler(engine, 3)
    seen = [(key, sorted(scheduler.lanes)) for key, _, _ in scheduler.run(reqs)]
    assert [key for key, _ in seen][-1] == 0 and seen[0][1] == [2, 8]  # the long row last; both lanes at first
    assert seen[-1][1] == [8]  # the width-2 lane went once its rows had left
    assert scheduler.lanes == {}
