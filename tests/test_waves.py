"""The bidirectional running set (`decode.waves`): rows of the fast strategy admitted as others leave, each
at its own block and step, answer exactly as the static fast decoder gives them alone (float32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli.arch import invariant
from celeris_cli.decode import waves
from celeris_cli.decode.runset import RowRequest
from celeris_cli.decode.sampling import RowNoise, request_seed
from celeris_cli.decode.strategies import Net, fast_plan_of, get_strategy
from celeris_cli.engine import Engine

from .conftest import make_model
from .test_running import PROMPTS, feed_while_running


@pytest.fixture(scope="module")
def llada(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Engine:
    """A random bidirectional model whose EOS logit is amplified, so rows end at different places."""
    from safetensors.torch import load_file, save_file

    from celeris_cli import load_engine

    folder = make_model(tmp_path_factory.mktemp("waves") / "m", tiny_tokenizer, seed=9)
    state = load_file(str(folder / "model.safetensors"))
    head = state["model.transformer.ff_out.weight"]
    head[2] = head[2] * 2.5 + head.mean(0)  # eos
    save_file(state, str(folder / "model.safetensors"))
    return load_engine(folder, device="cpu", dtype="float32")


def _alone(engine: Engine, prompt: str, params: Any, seed: int) -> list[int]:
    """The static fast decoder (`generate_fast`) on the one row: the answer the running set must give."""
    ids = engine.encode_prompt(prompt)
    x = torch.tensor([ids])
    noise = RowNoise([request_seed(seed, ids)], torch.device("cpu"))
    every = torch.ones_like(x, dtype=torch.bool)
    out = get_strategy("fast")(Net(engine.model), x, every, params, engine.special, noise)
    return out[0, len(ids) :].tolist()


def _running(engine: Engine, rows: list[tuple[str, Any, int]], max_batch: int, refill: bool = True) -> list[list[int]]:
    scheduler = waves.WaveScheduler(
        Net(engine.model), engine.special.mask_id, engine.special.stop_ids, max_batch,
        torch.device("cpu"), refill=refill,
    )  # fmt: skip
    admitted_beside: list[int] = []  # rows in flight when each row was admitted
    admit = scheduler._admit

    def spy(req: RowRequest[Any]) -> Any:
        admitted_beside.append(len(live))
        live.add(req.key)
        return admit(req)

    live: set[int] = set()
    scheduler._admit = spy  # type: ignore[method-assign]
    got = {}
    requests = []
    for i, (p, s, seed) in enumerate(rows):
        ids = engine.encode_prompt(p)
        requests.append(RowRequest(i, ids, fast_plan_of(s), request_seed(seed, ids)))
    for key, out, _ in scheduler.run(requests):
        got[key] = out
        live.discard(key)
    _running.admitted_beside = admitted_beside  # type: ignore[attr-defined]
    _running.occupancy = scheduler.occupancy  # type: ignore[attr-defined]
    return [got[i] for i in range(len(rows))]


def _settings(i: int, temperature: float) -> dict[str, Any]:
    return {
        "strategy": "fast",
        "temperature": temperature,
        "gen_length": 8 + 6 * i,  # answers of many lengths: rows leave and others join all along
        "block_length": 4 if i % 3 == 0 else 8,  # widths mixed in one running set
        "denoise_steps": 4 + i,
        "cache": ("prefix", "dual", "none")[i % 3],
        "suffix_window": 4 * (i % 2),
        "threshold": 0.9 if i % 2 else 1.0,
        "min_p": 0.05 * (i % 2),
        "seed": i,
    }


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_every_length_joining_mid_run_answer_as_the_static_decoder_alone(
    llada: Engine, temperature: float
) -> None:
    rows = [(p, llada.params(_settings(i, temperature)), i) for i, p in enumerate(PROMPTS * 2)]
    running = _running(llada, rows, max_batch=3)
    assert running == [_alone(llada, p, s, seed) for p, s, seed in rows]
    beside = _running.admitted_beside  # type: ignore[attr-defined]
    assert beside[:3] == [0, 1, 2] and min(beside[3:]) >= 1  # no later row waited for the set to empty
    assert len({llada.finish(ids)[1] for ids in running}) > 4  # and they did end at different places


def test_shaping_confidence_and_early_exit_apply_per_row(llada: Engine) -> None:
    rows = []
    for i, prompt in enumerate(PROMPTS):
        settings = {"strategy": "fast", "gen_length": 24, "block_length": 8, "threshold": 0.5 + 0.1 * i, "seed": 3}
        if i % 2:
            settings |= {"presence_penalty": 1.5, "min_tokens": 6, "order_temperature": 1.0, "confidence": "lead"}
        else:
            settings |= {"early_exit": False, "confidence": "margin"}
        rows.append((prompt, llada.params(settings), 3))
    assert _running(llada, rows, max_batch=4) == [_alone(llada, p, s, seed) for p, s, seed in rows]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_rows_take_a_second_slot_and_answer_as_the_static_guided_decoder_alone(
    llada: Engine, temperature: float
) -> None:
    """Guidance's unconditional view (the prompt masked) is a second segment of the row in every tick, in
    a lane of its own for each cache mode: guided and unguided rows of every cache mode, width and length
    share the waves and answer as `generate_fast` gives them alone."""
    rows = []
    for i, p in enumerate(PROMPTS * 2):
        settings = _settings(i, temperature) | {"cfg_scale": [0.0, 1.0, 2.0, 1.5][i % 4]}
        rows.append((p, llada.params(settings), i))
    running = _running(llada, rows, max_batch=3)
    alone = [_alone(llada, p, s, seed) for p, s, seed in rows]
    assert running == alone
    unguided = [_alone(llada, p, s.with_(cfg_scale=0.0), seed) for p, s, seed in rows]
    assert sum(a != u for a, u in zip(alone, unguided)) >= 3  # guidance changed these answers


def test_min_tokens_holds_back_the_stop_each_row_would_commit_early_beside_other_rows(llada: Engine) -> None:
    """min_tokens on prompts that do stop early without it: each row's ban covers its own first answer
    positions (its block's offset in its answer, not its canvas), as it does alone."""
    stop = llada.special.stop_ids
    base = {"strategy": "fast", "gen_length": 24, "block_length": 8, "seed": 3}
    free = [_alone(llada, p, llada.params(base), 3) for p in PROMPTS]
    first_stop = [next((j for j, t in enumerate(ids) if t in stop), len(ids)) for ids in free]
    k = 12
    assert sum(j < k for j in first_stop) >= 3, first_stop  # the prompts want to stop before k
    rows = [(p, llada.params(base | {"min_tokens": k}), 3) for p in PROMPTS]
    running = _running(llada, rows, max_batch=4)
    assert running == [_alone(llada, p, s, seed) for p, s, seed in rows]
    assert all(not any(t in stop for t in ids[:k]) for ids in running)


def test_static_batches_through_the_same_loop_give_the_same_answers(llada: Engine) -> None:
    rows = [(p, llada.params(_settings(i, 1.0)), i) for i, p in enumerate(PROMPTS)]
    continuous = _running(llada, rows, max_batch=2)
    static = _running(llada, rows, max_batch=2, refill=False)
    assert static == continuous
    assert _running.admitted_beside == [0, 1, 0, 1, 0, 1]  # type: ignore[attr-defined]  # a batch at a time


def test_the_engine_runs_fast_rows_through_the_waves_guided_or_not(llada: Engine) -> None:
    fast = llada.params({"strategy": "fast", "gen_length": 16})
    assert llada.continuous(fast)
    assert llada.continuous(llada.params({"strategy": "fast", "gen_length": 16, "cfg_scale": 1.0}))
    prompts = PROMPTS
    encoded = [llada.encode_prompt(p) for p in prompts]
    seeds = list(range(len(prompts)))
    llada.last_occupancy = None
    results = llada.decode_running(prompts, encoded, [fast] * len(prompts), seeds, 2)
    occupancy = llada.last_occupancy
    assert occupancy is not None and occupancy.rounds > 0  # the waves ran them
    static = llada.generate(prompts, fast, batch_size=2, seeds=seeds, scheduling="static")
    assert [r.text for r in results] == [r.text for r in static]


def test_the_running_sets_build_no_autograd_graph(llada: Engine) -> None:
    """The weights require grad; a forward outside no_grad chained a graph through the caches from tick
    to tick: 2 GB after 20 steps of the mixed workload, until the process was killed."""
    assert any(p.requires_grad for p in llada.model.parameters())
    rows = [(p, llada.params(_settings(i, 1.0) | {"cache": "prefix"}), i) for i, p in enumerate(PROMPTS[:3])]
    scheduler = waves.WaveScheduler(
        Net(llada.model), llada.special.mask_id, llada.special.stop_ids, 3, torch.device("cpu")
    )
    requests = [RowRequest(i, llada.encode_prompt(p), fast_plan_of(s), seed) for i, (p, s, seed) in enumerate(rows)]
    caches = [lane.cache for _ in scheduler.run(requests) for lane in scheduler.lanes.values() if lane.cache.layers]
    assert caches and all(not cache.layers[0][0].requires_grad for cache in caches)
    assert scheduler.lanes == {}  # each cache given back once no row is in flight


def test_a_rows_logits_are_bit_for_bit_those_it_has_alone_beside_wider_rows(llada: Engine) -> None:
    """A row's forward runs beside rows of other widths and places; SDPA's float32 result for a row changes
    with the number of keys even where the extra ones are masked (padded batches once made it so), so each
    row attends over exactly its own (`arch.packed`). Compared bit for bit, not by the answers, with
    the linear layers' rows tiled as in the deterministic mode (a matmul's float32 rounding may change with its
    number of rows, which is not what this pins)."""
    linear = invariant.linear

    def tiled(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        with invariant.enabled(True):
            return linear(x, w, b)

    seen: dict[tuple[int, int, int], torch.Tensor] = {}
    commit = waves.WaveScheduler._commit

    def spy(self: waves.WaveScheduler, stepped: list[Any]) -> None:
        for part in stepped:
            seen[(part.row.req.key, part.row.block, part.row.step)] = self.net.head(part.hidden[0]).clone()
        commit(self, stepped)

    base = {"strategy": "fast", "temperature": 0.0, "early_exit": False, "denoise_steps": 8}
    narrow = {**base, "gen_length": 16, "block_length": 8, "cache": "dual"}
    wider = [{**base, "gen_length": g, "block_length": 8, "cache": c} for g, c in ((40, "dual"), (96, "dual"))]
    prompt = PROMPTS[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(waves.WaveScheduler, "_commit", spy)
        mp.setattr(invariant, "linear", tiled)
        _running(llada, [(prompt, llada.params(narrow), 0)], max_batch=1)
        alone = {k[1:]: v for k, v in seen.items()}
        seen.clear()
        rows = [(prompt, llada.params(narrow), 0)] + [(p, llada.params(s), 1) for p, s in zip(PROMPTS[1:], wider)]
        _running(llada, rows, max_batch=3)
    beside = {k[1:]: v for k, v in seen.items() if k[0] == 0}
    assert beside.keys() == alone.keys() and len(alone) > 4
    bad = [(k, float((beside[k] - a).abs().max())) for k, a in sorted(alone.items()) if not torch.equal(beside[k], a)]
    assert not bad, bad


def test_a_shifted_familys_rows_answer_as_the_static_decoder_alone(llada: Engine) -> None:
    """Families whose position j-1 predicts position j (Dream, CoDA, RND1 run `fast` too): the block's
    logits come from the hidden states one column to the left, in the refresh and in each step's window."""
    model = llada.model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "logit_shift", 1)
        rows = [(p, llada.params(_settings(i, 0.0)), i) for i, p in enumerate(PROMPTS)]
        running = _running(llada, rows, max_batch=2)
        assert running == [_alone(llada, p, s, seed) for p, s, seed in rows]


def test_generate_decodes_a_bidirectional_models_prompts_through_the_running_set(llada: Engine, tmp_path: Path) -> None:
    """`celeris generate --file` (and `Engine.generate`) on a fast-strategy model: one running set, rows
    admitted as others finish, each answer its request's alone; `static` decodes one batch after another."""
    from typer.testing import CliRunner

    from celeris_cli.cli import app

    runs: list[bool] = []  # each waves running set made: whether it refills
    init = waves.WaveScheduler.__init__

    def spy(self: waves.WaveScheduler, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        runs.append(self.refill)

    settings = {"strategy": "fast", "temperature": 1.0, "gen_length": 24, "block_length": 8, "denoise_steps": 8}
    (tmp_path / "in.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    args = ["generate", "--model", str(llada.model_dir), "--file", str(tmp_path / "in.txt"), "--jsonl",
            "--batch-size", "2", "--device", "cpu", "--dtype", "float32", "--strategy", "fast", "--temperature", "1.0",
            "--gen-length", "24", "--block-length", "8", "--denoise-steps", "8"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(waves.WaveScheduler, "__init__", spy)
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        assert runs == [True]
        params = llada.params(settings)
        got = [json.loads(line)["text"] for line in r.stdout.splitlines()]
        assert got == [llada.generate([p], params)[0].text for p in PROMPTS]
        runs.clear()
        llada.generate(PROMPTS, params, batch_size=2, scheduling="static")
        assert len(runs) == (len(PROMPTS) + 1) // 2  # one batch after another, each its own running set


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_added_to_a_live_run_while_it_runs_answer_as_the_static_decoder_alone(
    llada: Engine, temperature: float
) -> None:
    """`Engine.live` (the queue, `celeris batch`, serve) feeds fast rows to the waves between answers."""
    rows = [(p, llada.params(_settings(i, temperature)), i) for i, p in enumerate(PROMPTS * 2)]
    live = llada.live(max_batch=3)
    got, joined_while_running = feed_while_running(llada, live, rows)
    assert live.kinds == {"waves"}
    alone = [llada.finish(_alone(llada, p, s, seed), s.stop, llada.encode_prompt(p))[0] for p, s, seed in rows]
    assert [got[k] for k in range(len(rows))] == alone
    assert any(joined_while_running)
    assert live.accepts(llada.params({"strategy": "fast", "cfg_scale": 1.0}))  # guidance: a second slot a row


def test_a_live_run_of_fast_rows_out_of_memory_narrows_and_a_row_too_large_alone_fails_alone(llada: Engine) -> None:
    from celeris_cli.errors import TooLarge

    from .test_memory_backoff import LONG, OutOfMemoryAbove

    params = llada.params({"strategy": "fast", "gen_length": 16, "block_length": 8, "denoise_steps": 8})
    alone = {p: llada.generate([p], params)[0].text for p in PROMPTS}
    real = llada.model
    llada.model = OutOfMemoryAbove(real, rows=99, width=60)  # type: ignore[assignment]  (a packed forward: 1 row)
    try:
        live = llada.live(max_batch=6)
        prompts = PROMPTS[:3] + [LONG * 2] + PROMPTS[3:]
        for k, p in enumerate(prompts):
            live.add(k, p, llada.encode_prompt(p), params, params.seed)
        got = dict(live.answers())
        widths = [n for _, n in llada.model.shapes]  # type: ignore[attr-defined]
    finally:
        llada.model = real
    assert max(widths) > 60 and widths[-1] <= 60  # it ran out of memory, and went on narrower
    assert isinstance(got[3], TooLarge) and "out of memory alone" in str(got[3])
    assert {prompts[k]: r.text for k, r in got.items() if k != 3} == alone  # type: ignore[union-attr]
    assert not live.pending
