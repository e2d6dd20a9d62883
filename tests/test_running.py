"""The running set (`decode.running`): rows admitted as others finish, each at its own place over its own
cache slot, answer exactly as they do alone (float32), whatever they ran beside and whenever they joined."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.kv import KVCache, LayerKV
from celeris_cli.engine import Engine

from .conftest import decoded_alone, make_model, predicting_the_mask

LLADA2 = Path(__file__).parent / "data" / "llada2" / "llada2_tiny"
PROMPTS = [
    "床前明月光",
    "the cat sat on",
    "春眠不觉晓，处处闻啼鸟。夜来风雨声",
    "a",
    "the moon and the sun and",
    "白日依山尽",
]


@pytest.fixture(scope="module")
def block_engine(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Engine:
    """A random block-causal model whose EOS logit is amplified, so rows end at different places."""
    from safetensors.torch import load_file, save_file

    folder = make_model(tmp_path_factory.mktemp("blk") / "m", tiny_tokenizer, seed=9, block_causal=True)
    state = load_file(str(folder / "model.safetensors"))
    head = state["model.transformer.ff_out.weight"]
    head[2] = head[2] * 2.5 + head.mean(0)  # eos
    save_file(state, str(folder / "model.safetensors"))
    return load_engine(folder, device="cpu", dtype="float32")


def _alone(engine: Engine, prompt: str, params, seed: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The request decoded alone by its strategy's own decoder (`generate_block_cached`), not the running set."""
    return decoded_alone(engine, prompt, params, seed)


def _running(engine: Engine, rows: list[tuple[str, object, int]], max_batch: int) -> list[list[int]]:
    """Each row's generated ids through the running set (uncut, as `decode_ids` gives them)."""
    got: dict[int, list[int]] = {}
    original = engine._result

    def keep(prompt, ids_in, out, *rest):  # type: ignore[no-untyped-def]
        got[len(got)] = out
        return original(prompt, ids_in, out, *rest)

    order: list[int] = []
    engine._result = keep  # type: ignore[method-assign]
    try:
        engine.decode_running(
            [p for p, _, _ in rows],
            [engine.encode_prompt(p) for p, _, _ in rows],
            [s for _, s, _ in rows],  # type: ignore[misc]
            [seed for _, _, seed in rows],
            max_batch,
            lambda i, r: order.append(i),
        )
    finally:
        del engine._result
    return [got[order.index(i)] for i in range(len(rows))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_every_length_joining_mid_run_answer_as_they_do_alone(block_engine: Engine, temperature: float) -> None:
    rows = []
    for i, prompt in enumerate(PROMPTS * 2):
        settings = {
            "temperature": temperature,
            "gen_length": 8 + 6 * i,  # answers of many lengths: rows leave and others join all along
            "block_length": 4 if i % 3 == 0 else 8,  # widths mixed in one running set
            "denoise_steps": 4 + i,
            "min_p": 0.05 * (i % 2),
            "seed": i,
        }
        rows.append((prompt, block_engine.params(settings), i))
    running = _running(block_engine, rows, max_batch=3)
    occupancy = block_engine.last_occupancy
    alone = [_alone(block_engine, p, s, seed) for p, s, seed in rows]
    assert running == alone
    assert occupancy is not None and occupancy.mean_in_flight > 2.2  # three rows in flight but at the tail
    lengths = {block_engine.finish(ids)[1] for ids in running}
    assert len(lengths) > 4  # and they did end at different places


def test_shaping_and_thresholds_apply_per_row_in_one_running_set(block_engine: Engine) -> None:
    rows = []
    for i, prompt in enumerate(PROMPTS):
        settings = {"gen_length": 24, "threshold": 0.5 + 0.1 * i, "seed": 3}
        if i % 2:
            settings |= {"presence_penalty": 1.5, "min_tokens": 6, "order_temperature": 1.0}
        rows.append((prompt, block_engine.params(settings), 3))
    assert _running(block_engine, rows, max_batch=4) == [_alone(block_engine, p, s, seed) for p, s, seed in rows]


def test_block_model_presets_share_one_running_set_and_answer_as_alone() -> None:
    engine = load_engine("celeris-block", device="cpu", dtype="float32")
    prompts = ["床前明月光，", "The old man walked", "春眠不觉晓，", "She opened the door and", "白日依山尽，"]
    params = engine.params({"gen_length": 24, "seed": 5})
    running = engine.generate(prompts, params, batch_size=3)
    occupancy = engine.last_occupancy
    alone = [engine.finish(_alone(engine, p, engine.params_for(p, params), 5), (), engine.encode_prompt(p))[0]
             for p in prompts]  # fmt: skip
    assert [r.text for r in running] == alone
    # two presets (block widths 8 and 4) ran side by side rather than in separate batches
    assert occupancy is not None and occupancy.mean_in_flight > 2


def test_llada2_rows_joining_mid_run_answer_as_alone() -> None:
    engine = load_engine(LLADA2, device="cpu", dtype="float32")
    prompts = ["Bob likes", "What is 3 plus 4? Tell me", "a b c d e f g h i j k l m n o p q r s t u v w x y z", "hi"]
    rows = [
        (p, engine.params({"gen_length": 20 + 12 * i, "block_length": 8, "seed": i}), i) for i, p in enumerate(prompts)
    ]
    assert _running(engine, rows, max_batch=2) == [_alone(engine, p, s, seed) for p, s, seed in rows]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_rows_join_the_running_set_beside_others_and_answer_as_alone(
    block_engine: Engine, temperature: float
) -> None:
    """Guidance's unconditional view is a second slot per row (its lane's shadow, the prompt masked): guided
    rows of several widths and lengths, prompts with whole blocks to prefill among them, join mid-run beside
    unguided rows and answer as the guided decoder (`generate_block_cached`) gives them alone."""
    assert block_engine.continuous(block_engine.params({"cfg_scale": 1.0, "gen_length": 8}))
    rows = []
    for i, prompt in enumerate(PROMPTS * 2):
        settings = {
            "temperature": temperature,
            "gen_length": 8 + 4 * i,
            "block_length": 4 if i % 3 == 0 else 8,
            "cfg_scale": [0.0, 1.0, 2.5][i % 3],
            "seed": i,
        }
        rows.append((prompt, block_engine.params(settings), i))
    running = _running(block_engine, rows, max_batch=3)
    alone = [_alone(block_engine, p, s, seed) for p, s, seed in rows]
    assert running == alone
    unguided = [_alone(block_engine, p, s.with_(cfg_scale=0.0), seed) for p, s, seed in rows]
    assert sum(a != u for a, u in zip(alone, unguided)) >= 3  # guidance changed these answers


def test_layer_cache_writes_each_row_at_its_own_start() -> None:
    k = torch.zeros(3, 2, 10, 4)
    v = torch.zeros(3, 2, 10, 4)
    fresh_k, fresh_v = torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4)
    starts = torch.tensor([0, 4, 7])
    LayerKV(k, v).update(fresh_k, fresh_v, starts)
    for b, s in enumerate(starts.tolist()):
        one_k, one_v = torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4)
        LayerKV(one_k, one_v).update(fresh_k[b : b + 1], fresh_v[b : b + 1], s)
        assert torch.equal(k[b], one_k[0]) and torch.equal(v[b], one_v[0])


def test_cache_move_and_grow_keep_the_written_positions() -> None:
    cache = KVCache.empty(2, 3, 1, 4, 2, torch.float32, torch.device("cpu"))
    for layer in cache.layers:
        for t in layer:
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    before = [t[2, :, :3].clone() for layer in cache.layers for t in layer]
    cache.move(2, 0, 3)
    cache.grow(9, keep_rows=3)
    assert cache.length == 9
    after = [t[0, :, :3] for layer in cache.layers for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(float(t[:, :, 4:].abs().sum()) == 0 for layer in cache.layers for t in layer)  # grown zeroed


@pytest.mark.parametrize(
    "settings", [{"temperature": 0.9}, {"temperature": 0.7, "min_p": 0.05, "order_temperature": 0.5}]
)
def test_a_rows_noise_and_commit_do_not_change_with_the_rows_beside_it(block_engine: Engine, settings: dict) -> None:  # type: ignore[type-arg]
    """The commit step draws each row's noise from its own generator and as many numbers as its own masked
    positions need: a row commits the same tokens alone, beside 2 rows, or beside 15."""
    from types import SimpleNamespace

    from celeris_cli.decode.block import commit_step
    from celeris_cli.decode.sampling import Draws, stream_seed
    from celeris_cli.decode.strategies import plan_of

    plan = plan_of(block_engine.params(settings))
    mask, V, W = block_engine.tokenizer.mask_id, 48, 8
    # logits are the hidden states: no matmul whose shape could round; a chunk of 7 splits a row's positions
    net = SimpleNamespace(step_head=lambda: lambda h: h, chunk=7)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, W, V, generator=g) * 3
    block = torch.randint(0, V, (16, W), generator=g)
    block[torch.rand(16, W, generator=g) < 0.6] = mask  # each row its own masked positions
    block[0, :] = mask
    k = torch.tensor([1 + b % 3 for b in range(16)])
    stop = torch.tensor([2])

    def step(rows: list[int]) -> torch.Tensor:
        draws = Draws([stream_seed(100 + b, 0, 1) for b in rows], torch.device("cpu"))
        return commit_step(block[rows], [hidden[rows]], net, plan, k[rows], mask, draws, None, stop)  # type: ignore[arg-type]

    alone = torch.stack([step([b])[0] for b in range(16)])
    assert torch.equal(step(list(range(16))), alone)
    assert torch.equal(step([0, 5, 9]), alone[[0, 5, 9]])
    assert not torch.equal(step(list(range(16)))[0], block[0])  # something was committed


def test_a_block_ends_after_its_steps_when_the_model_predicts_the_mask_itself(
    block_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Committing the mask token commits nothing; a row still leaves its block after its own steps (as the
    static decoders do) instead of stepping forever."""
    mask, calls = block_engine.tokenizer.mask_id, [0]
    monkeypatch.setattr(block_engine.model, "step_head", predicting_the_mask(block_engine.model, mask, 200, calls))
    params = block_engine.params({"gen_length": 16, "temperature": 0.0})
    prompt = block_engine.encode_prompt("the cat sat on")
    [out], _ = block_engine.decode_ids([prompt], params)
    assert out[:16] == [mask] * 16
    assert calls[0] == sum(params.steps_for(len(prompt)))  # each block's steps, then on


def test_the_running_set_builds_no_autograd_graph(block_engine: Engine) -> None:
    """The weights require grad; outside no_grad every forward's graph chained through the preallocated
    caches from round to round (memory grew with every step)."""
    from celeris_cli.decode.running import BlockScheduler
    from celeris_cli.decode.runset import RowRequest
    from celeris_cli.decode.sampling import request_seed
    from celeris_cli.decode.strategies import Net, plan_of

    assert any(p.requires_grad for p in block_engine.model.parameters())
    sp = block_engine.special
    scheduler = BlockScheduler(Net(block_engine.model), sp.mask_id, sp.stop_ids, sp.pad_id, 2, torch.device("cpu"))
    plan = plan_of(block_engine.params({"gen_length": 16}))
    requests = [
        RowRequest(i, ids, plan, request_seed(i, ids))
        for i, ids in enumerate(block_engine.encode_prompt(p) for p in PROMPTS[:3])
    ]
    caches = [lane.cache for _ in scheduler.run(requests) for lane in scheduler.lanes.values()]
    assert caches and all(not cache.layers[0][0].requires_grad for cache in caches)


def test_each_widths_cache_is_allocated_once_for_the_longest_canvas(block_engine: Engine) -> None:
    """Growing it when a longer row joined held the old and the new cache at once and doubled its length."""
    from celeris_cli.decode.running import BlockScheduler
    from celeris_cli.decode.runset import RowRequest
    from celeris_cli.decode.sampling import request_seed
    from celeris_cli.decode.strategies import Net, plan_of

    sp = block_engine.special
    scheduler = BlockScheduler(Net(block_engine.model), sp.mask_id, sp.stop_ids, sp.pad_id, 2, torch.device("cpu"))
    plan = plan_of(block_engine.params({"gen_length": 16, "block_length": 4}))
    prompts = ["a", "a", "春眠不觉晓，处处闻啼鸟。夜来风雨声"]  # the longest canvas joins last
    requests = [
        RowRequest(i, ids, plan, request_seed(i, ids)) for i, ids in enumerate(map(block_engine.encode_prompt, prompts))
    ]
    longest = max(-(-(len(r.prompt) + 16) // 4) * 4 for r in requests)
    allocate, made = scheduler._allocate, []

    def counted(rows: int, length: int) -> Any:
        made.append((length, rows))
        return allocate(rows, length)

    scheduler._allocate = counted  # type: ignore[method-assign]
    shapes = {
        (lane.cache.length, lane.cache.rows) for _ in scheduler.run(requests) for lane in scheduler.lanes.values()
    }
    assert made == [(longest, 2)] and shapes == {(longest, 2)}  # one cache, made once, never grown


def test_in_a_live_run_each_widths_cache_is_still_sized_once_for_every_row_queued(
    block_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `LiveRun` (`KindSet`: requests wait in its queue and reach the block set one at a time as they
    join), the block set still sizes its cache for every row queued (`reserve`), so the longest canvas joining
    last finds it long enough: one cache, made once, never grown."""
    from celeris_cli.decode.running import BlockScheduler

    params = block_engine.params({"gen_length": 16, "block_length": 4})
    prompts = ["a", "a", "春眠不觉晓，处处闻啼鸟。夜来风雨声"]  # the longest canvas joins last
    longest = max(-(-(len(block_engine.encode_prompt(p)) + 16) // 4) * 4 for p in prompts)
    allocate, made = BlockScheduler._allocate, []

    def counted(self: BlockScheduler, rows: int, length: int) -> Any:
        made.append((length, rows))
        return allocate(self, rows, length)

    monkeypatch.setattr(BlockScheduler, "_allocate", counted)
    live = block_engine.live(max_batch=2)
    for i, p in enumerate(prompts):
        live.add(i, p, block_engine.encode_prompt(p), params, i)
    shapes = set()
    for _ in live.answers():
        block = live.scheduler.kinds["block"]  # type: ignore[union-attr]
        shapes |= {(lane.cache.length, lane.cache.rows) for lane in block.lanes.values()}
    assert made == [(longest, 2)] and shapes == {(longest, 2)}


def test_a_lane_whose_rows_have_all_left_gives_its_cache_back(block_engine: Engine) -> None:
    """Two block widths: once the short answers of one width are all handed back, the set holds only the
    other width's lane and cache while its long row runs on; and none once the run is over."""
    from celeris_cli.decode.running import BlockScheduler
    from celeris_cli.decode.runset import RowRequest
    from celeris_cli.decode.sampling import request_seed
    from celeris_cli.decode.strategies import Net, plan_of

    sp = block_engine.special
    scheduler = BlockScheduler(Net(block_engine.model), sp.mask_id, sp.stop_ids, sp.pad_id, 3, torch.device("cpu"))
    short = plan_of(block_engine.params({"gen_length": 4, "block_length": 4}))
    long = plan_of(block_engine.params({"gen_length": 32, "block_length": 8, "cfg_scale": 1.5}))  # and its shadow
    ids = block_engine.encode_prompt("a")
    requests = [RowRequest(0, ids, long, request_seed(0, ids))]
    requests += [RowRequest(k, ids, short, request_seed(k, ids)) for k in (1, 2)]
    widths = [(key, sorted(scheduler.lanes), sorted(scheduler.shadows)) for key, _, _ in scheduler.run(requests)]
    assert [key for key, _, _ in widths] == [1, 2, 0]  # the short rows first
    assert widths[0][1:] == ([4, 8], [8])  # (handed back from the lane they were in); the guided row's shadow
    assert widths[2][1:] == ([8], [8])  # the width-4 lane went as soon as its rows had left
    assert scheduler.lanes == {} and scheduler.shadows == {}


def test_a_memory_budget_counts_a_cache_for_each_block_width(block_engine: Engine) -> None:
    """Each width's lane allocates its own slots, so two widths hold two caches; sizing the set for one
    width's rows let a budget be overrun by nearly the second cache."""
    engine = load_engine(block_engine.model_dir, device="cpu", dtype="float32", max_memory="1TiB")
    four, eight = (engine.params({"gen_length": 64, "block_length": w}) for w in (4, 8))
    encoded = [engine.encode_prompt(p) for p in PROMPTS * 2]
    engine.memory.budget = engine.memory.need([max(encoded, key=len)] * 4, eight)  # four rows of one width
    assert engine._running_width(encoded, [eight] * 12, 4) == 4
    assert engine._running_width(encoded, [four, eight] * 6, 4) < 4


def feed_while_running(
    engine: Engine, live: Any, rows: list[tuple[str, Any, int]]
) -> tuple[dict[int, str], list[bool]]:
    """Rows (prompt, final settings, seed) added to a live running set under keys 0, 1, ...: the first
    before it runs (its lane's cache starts with one slot), then two each time one leaves. Returns each
    key's text and, for each later row, whether others were in flight as it joined."""
    added = 0

    def add() -> None:
        nonlocal added
        prompt, params, seed = rows[added]
        live.add(added, prompt, engine.encode_prompt(prompt), params, seed)
        added += 1

    add()
    got: dict[int, str] = {}
    joined_while_running = []
    for key, result in live.answers():
        got[key] = result.text
        for _ in range(2):
            if added < len(rows):
                joined_while_running.append(live.scheduler is not None and live.scheduler.in_flight > 1)
                add()
    return got, joined_while_running


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_added_while_the_running_set_runs_answer_as_they_do_alone(
    block_engine: Engine, temperature: float
) -> None:
    live = block_engine.live(max_batch=3)
    rows = []
    for i, prompt in enumerate(PROMPTS * 2):
        settings = {"temperature": temperature, "gen_length": 8 + 5 * i, "block_length": 4 if i % 3 else 8, "seed": i}
        rows.append((prompt, block_engine.params(settings), i))
    got, joined_while_running = feed_while_running(block_engine, live, rows)
    alone = [block_engine.finish(_alone(block_engine, p, s, seed), s.stop, block_engine.encode_prompt(p))[0]
             for p, s, seed in rows]  # fmt: skip
    assert [got[k] for k in range(len(rows))] == alone
    assert any(joined_while_running)


def test_a_live_running_set_out_of_memory_narrows_and_a_row_too_large_alone_fails_alone(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path
) -> None:
    from celeris_cli.errors import TooLarge

    from .test_memory_backoff import LONG, SETTINGS, OutOfMemoryAbove

    folder = make_model(tmp_path_factory.mktemp("oomlive") / "m", tiny_tokenizer, seed=4, block_causal=True)
    engine = load_engine(folder, device="cpu", dtype="float32")
    params = engine.params({"strategy": "block-fast", **SETTINGS})
    alone = {p: engine.generate([p], params)[0].text for p in PROMPTS}
    engine.model = OutOfMemoryAbove(engine.model, rows=2, width=40)  # type: ignore[assignment]
    live = engine.live(max_batch=6)
    prompts = PROMPTS[:3] + [LONG] + PROMPTS[3:]
    for k, p in enumerate(prompts):
        live.add(k, p, engine.encode_prompt(p), params, params.seed)
    got = dict(live.answers())
    assert isinstance(got[3], TooLarge) and "out of memory alone" in str(got[3])
    assert {prompts[k]: r.text for k, r in got.items() if k != 3} == alone  # type: ignore[union-attr]
    assert not live.pending


def test_a_live_running_set_under_a_memory_budget_runs_only_as_many_rows_as_fit(block_engine: Engine) -> None:
    from .test_memory_backoff import OutOfMemoryAbove

    params = block_engine.params({"gen_length": 24, "block_length": 8})
    ids = [block_engine.encode_prompt(p) for p in PROMPTS]
    two = block_engine.memory.need([max(ids, key=len)] * 2, params)
    real, budget = block_engine.model, block_engine.memory.budget
    block_engine.model = OutOfMemoryAbove(real, rows=99, width=9999)  # type: ignore[assignment]  (records shapes)
    block_engine.memory.budget = two
    try:
        live = block_engine.live(max_batch=6)
        for k, (p, i) in enumerate(zip(PROMPTS, ids)):
            live.add(k, p, i, params, 0)
        assert live.width == 2
        got = dict(live.answers())
        widest = max(rows for rows, _ in block_engine.model.shapes)  # type: ignore[attr-defined]
    finally:
        block_engine.model, block_engine.memory.budget = real, budget
    assert widest == 2 and len(got) == len(PROMPTS)


def test_a_rows_attention_does_not_change_with_how_far_the_rows_beside_it_reach() -> None:
    """SDPA's float32 result for a row changes with the number of keys even where the extra ones are
    masked; the running set's rows attend over exactly their own keys (`LayerKV.exact`)."""
    from celeris_cli.arch.layers import attend

    g = torch.Generator().manual_seed(0)
    H, D, W = 4, 16, 8
    starts = torch.tensor([0, 40])  # the second row reaches key 48, the first only key 8
    q, k, v = (torch.randn(2, H, W, D, generator=g) for _ in range(3))

    def row0(n: int, L: int) -> torch.Tensor:
        cache = KVCache.empty(1, n, H, 64, D, torch.float32, torch.device("cpu"))
        keys = torch.arange(L)[None, :] < (starts[:n] + W)[:, None]
        y, _ = attend(q[:n], k[:n], v[:n], keys[:, None, None, :], cache.view(slice(0, n), L, exact=True)[0],
                      starts[:n], False)  # fmt: skip
        return y[0]

    assert torch.equal(row0(2, 48), row0(1, 8))


def test_the_default_models_answers_in_a_running_set_of_16_equal_each_alone() -> None:
    """The 195 requests of the queue's SIGKILL test (tests/test_serve_batch.py): before `LayerKV.exact`,
    one of them ("Shall I compare 117") answered otherwise beside its batch mates than alone."""
    from celeris_cli import load_engine

    engine = load_engine("celeris-block", device="cpu", dtype="float32")
    starts = ["The quick", "床前明月光，", "Shall I compare", "白日依山尽，", "To be, or not"]
    prompts = [f"{starts[i % 5]} {i}" for i in range(195)]
    params = [engine.params_for(p, engine.params({"gen_length": 8, "seed": i})) for i, p in enumerate(prompts)]
    encoded = [engine.encode_prompt(p) for p in prompts]
    together = engine.decode_running(prompts, encoded, params, list(range(195)), 16)
    for i in (117, 0, 58, 194):
        alone = engine.finish(_alone(engine, prompts[i], params[i], i), (), encoded[i])[0]
        assert together[i].text == alone, i


def test_a_threshold_below_one_commits_every_sure_position_and_takes_fewer_forwards() -> None:
    """celeris-block's `block-fast` in the running set: a threshold commits beside the schedule's share every
    position at least that sure, so blocks fill in fewer steps (the small model is rarely sure: 0.1); at 1 it
    is off."""
    engine = load_engine("celeris-block", device="cpu", dtype="float32")
    base = {"strategy": "block-fast", "gen_length": 32, "block_length": 8, "block_steps": 8, "temperature": 0.0}
    prompts = [engine.encode_prompt(p) for p in ("The river", "床前明月光，", "It was late")]
    strict, strict_nfe = engine.decode_ids(prompts, engine.params({**base, "threshold": 1.0}))
    loose, loose_nfe = engine.decode_ids(prompts, engine.params({**base, "threshold": 0.1}))
    assert loose_nfe < strict_nfe and loose != strict
