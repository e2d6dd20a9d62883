"""DiffusionGemma's canvases in the running set (`decode.canvasrun`): rows of different prompts, lengths, canvases,
seeds and samplers decode beside each other, joining as others leave, and each answers as the same request alone.

The oracles never run the running set: the static decoder on the request alone (`generate_diffusion_gemma`, a
batch of one), or transformers' own `generate`, recorded (tests/data/diffusion_gemma, as test_diffusion_gemma.py
reads it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.decode.sampling import RowNoise, request_seed
from celeris_cli.decode.strategies import Net, get_strategy
from celeris_cli.engine import Engine

DATA = Path(__file__).parent / "data" / "diffusion_gemma"
FOLDER = DATA / "diffusion_gemma_tiny"
REF = json.loads((DATA / "diffusion_gemma_reference.json").read_text(encoding="utf-8"))
PROMPTS = list(REF["prompts"].values())  # 3, 2, 18 and 8 tokens
KEYS = {"max_new_tokens": "gen_length", "t_min": "temperature_final", "t_max": "temperature"}
KEYS |= {"max_denoising_steps": "block_steps", "eos_token_id": "stop_token_ids"}

# prompt lengths, answer lengths, canvases, step caps, temperatures, stops, the adaptive stop on and off, pinned
# canvases and torch's noise: each row's own
MIXED: list[dict[str, Any]] = [
    {"gen_length": 24, "block_steps": 6, "seed": 1},
    {"gen_length": 8, "block_steps": 4, "seed": 2, "temperature": 1.0},
    {"gen_length": 16, "block_steps": 5, "seed": 3, "block_length": 4},
    {"gen_length": 32, "block_steps": 3, "seed": 4, "confidence_threshold": None},
    {"gen_length": 12, "block_steps": 6, "seed": 5, "temperature": 0.6, "temperature_final": 0.2},
    {"gen_length": 16, "block_steps": 6, "seed": 6, "noise": "torch"},
    {"gen_length": 16, "block_steps": 4, "seed": 7, "initial_canvases": [[5, 9, 200, 31, 7, 7, 64, 120]]},
    {"gen_length": 24, "block_steps": 5, "seed": 8, "stop_token_ids": [111, 300]},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(FOLDER, device="cpu", dtype="float32")


def alone(engine: Engine, ids: list[int], params: Any, seed: int) -> tuple[list[int], int]:
    """The request decoded by the static decoder as a batch of one (no running set): its generated ids and
    forwards."""
    prompt = torch.tensor([ids])
    noise = RowNoise([request_seed(seed, ids)], torch.device("cpu"), [seed])
    net = Net(engine.model)
    real = torch.ones_like(prompt, dtype=torch.bool)
    rule = engine.rule_for(params)
    extra = {} if rule is None else {"rules": [rule]}
    out = get_strategy("diffusion-gemma")(net, prompt, real, params, engine.special, noise, **extra)
    return out[0, len(ids) :].tolist(), net.nfe


def running(engine: Engine, rows: list[tuple[list[int], Any, int]], width: int) -> tuple[dict[int, Any], Any]:
    """Every row through one running set of `width` rows: {key: (generated ids, forwards)} and the set, with
    `joined_beside`: how many rows were in flight as each row joined."""
    scheduler, _ = engine._scheduler([p for _, p, _ in rows], width)
    requests = [engine._request(k, ids, p, seed, engine.rule_for(p)) for k, (ids, p, seed) in enumerate(rows)]
    admit, scheduler.joined_beside = scheduler._admit, []

    def recorded(req: Any) -> None:
        scheduler.joined_beside.append(scheduler.in_flight)
        admit(req)

    scheduler._admit = recorded
    return {k: (out, f) for k, out, f in scheduler.run(requests)}, scheduler


def mixed(engine: Engine) -> list[tuple[list[int], Any, int]]:
    out = []
    for i, s in enumerate(MIXED):
        out.append((engine.encode_prompt(PROMPTS[i % len(PROMPTS)]), engine.params(s), s["seed"]))
    return out


def test_diffusion_gemma_decodes_in_the_running_set(engine: Engine) -> None:
    assert all(engine.continuous(p) for _, p, _ in mixed(engine))
    assert engine.live(4).accepts(engine.params({}))


@pytest.mark.parametrize("width", [2, 8])
def test_mixed_rows_answer_each_as_alone_whoever_runs_beside_them(engine: Engine, width: int) -> None:
    """Width 2: six of the eight rows join as others leave (admission mid-run); width 8: all at once."""
    rows = mixed(engine)
    got, scheduler = running(engine, rows, width)
    expected = [alone(engine, ids, p, seed) for ids, p, seed in rows]
    assert [got[k] for k in range(len(rows))] == expected  # the ids and the forwards each row took part in
    assert len({tuple(ids) for ids, _ in expected}) == len(rows)
    occupancy = scheduler.occupancy
    assert occupancy.prefills == len(rows) and occupancy.mean_rows > 1.2  # rows shared their forwards
    assert occupancy.mean_in_flight <= width
    if width == 2:  # rows joined while others were part way through their canvases
        assert sum(n > 0 for n in scheduler.joined_beside) >= 4


def test_constrained_rows_beside_free_ones_answer_as_alone(engine: Engine) -> None:
    """Rows under a constraint (their canvases' committed prefixes, steps past a schedule of 2) beside free rows,
    two in flight: each as the static decoder gives it alone, the constraint holding."""
    pattern = "the [a-z]{2,9} (cat|dog)"
    rows = []
    for i, prompt in enumerate(["hello there", "the cat", "a dog sat", "why"]):
        s: dict[str, Any] = {"gen_length": 16 + 8 * (i % 2), "seed": i + 1, "block_steps": 2}
        if i != 2:
            s["structured_outputs"] = {"regex": pattern}
        rows.append((engine.encode_prompt(prompt), engine.params(s), i + 1))
    got, _ = running(engine, rows, 2)
    for k, (ids, p, seed) in enumerate(rows):
        assert got[k] == alone(engine, ids, p, seed)
        text = engine.finish(got[k][0], (), ids)[0]
        assert bool(re.fullmatch(pattern, text)) == (k != 2), text


def test_the_recorded_runs_beside_each_other_are_transformers_own(engine: Engine) -> None:
    """Every recorded run (greedy with pinned canvases, and torch's own draws: canvases of 8 and 12, stops,
    step caps, the adaptive stop's settings) through one running set of 4 rows answers as transformers'
    `generate` did for it alone."""
    rows, expected = [], []
    for kind in ("greedy", "sampled"):
        for case in REF[kind]:
            s = {KEYS.get(k, k): v for k, v in case["settings"].items()} | {"block_length": case["block_length"]}
            if kind == "greedy":
                s["initial_canvases"] = case["initial_canvases"]
            else:
                s["noise"] = "torch"
                if case.get("pinned_first_canvas"):
                    s["initial_canvases"] = case["initial_canvases"][:1]
            rows.append((case["input_ids"], engine.params(s | {"seed": case["seed"]}), case["seed"]))
            expected.append(engine.tokenizer.continuation(case["input_ids"], case["answer_ids"]))
    got, _ = running(engine, rows, 4)
    texts = [engine.finish(got[k][0], (), rows[k][0], rows[k][1].stop_token_ids)[0] for k in range(len(rows))]
    assert texts == expected


def test_serve_streams_canvas_by_canvas_and_a_cancelled_row_frees_its_slot(engine: Engine) -> None:
    """Through `Engine.live` (serve's path), one row in flight at a time: the first row is cancelled once its
    first canvas has streamed, and the next one takes its slot and answers as alone."""
    rows = mixed(engine)[:3]
    live = engine.live(1)
    streamed: dict[int, list[list[int]]] = {}
    live.on_block = lambda key, ids: streamed.setdefault(key, []).append(ids)
    live.before_round = lambda: live.cancel(0) if 0 in streamed else None
    for k, (ids, p, seed) in enumerate(rows):
        live.add(k, "", ids, p, seed)
    got = dict(live.answers())
    assert sorted(got) == [1, 2] and not live.pending
    assert len(streamed[0]) == 1  # it left before its second canvas
    for k in (1, 2):
        ids, p, seed = rows[k]
        out, forwards = alone(engine, ids, p, seed)
        assert got[k].text == engine.finish(out, p.stop, ids)[0] and got[k].nfe == forwards  # type: ignore[union-attr]
        L = p.block_length
        assert streamed[k] == [out[: (j + 1) * L] for j in range(len(streamed[k]))]  # a canvas at a time
    assert live.scheduler is not None and live.scheduler.in_flight == 0


def test_celeris_batch_of_six_goes_through_the_running_set_with_no_fallback(engine: Engine, tmp_path: Path) -> None:
    """Six requests of different lengths and seeds: each answer is the request's alone, with the forwards the
    request takes alone, decoded beside others, and nothing is decoded again."""
    lines = [{"prompt": PROMPTS[i % 4], "gen_length": g, "seed": 10 + i, "block_steps": 5, "custom_id": str(i)}
             for i, g in enumerate([8, 24, 16, 32, 12, 20])]  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = {"prompt": "a b", "initial_canvases": [[999] * 8], "custom_id": "bad"}  # refused alone, as it is prepared
    src.write_text("".join(json.dumps(line) + "\n" for line in [*lines, bad]), encoding="utf-8")
    cmd = [sys.executable, "-m", "celeris_cli", "batch", "-i", str(src), "-o", str(out), "--model", str(FOLDER)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd + ["--dtype", "float32", "--batch-size", "3"], capture_output=True, text=True, env=env)
    assert p.returncode == 1, p.stderr
    failed = [json.loads(line) for line in Path(f"{out}.failed.jsonl").read_text().splitlines()]
    assert [f["custom_id"] for f in failed] == ["bad"] and "outside the vocabulary of 320" in json.dumps(failed)
    assert "again" not in p.stderr and "one at a time" not in p.stderr and "running set failed" not in p.stderr
    answers = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(answers) == [str(i) for i in range(6)]
    for i, line in enumerate(lines):
        settings = {k: v for k, v in line.items() if k not in ("prompt", "custom_id")}
        ids, params = engine.encode_prompt(str(line["prompt"])), engine.params(settings)
        ids_out, forwards = alone(engine, ids, params, int(line["seed"]))
        body = answers[str(i)]
        assert body["text"] == engine.finish(ids_out, (), ids)[0]
        assert body["timing"]["nfe"] == forwards
        assert body["timing"]["batch_size"] == 3  # in a running set of 3 (static, each line would be its own batch)


def test_serve_streams_each_row_a_canvas_at_a_time(engine: Engine) -> None:
    """`serve`'s runner: rows streamed through its running set see their text after each canvas, and end
    with the answer the request gets alone."""
    from celeris_cli.serve.runner import Runner
    from celeris_cli.spool.formats import Request

    runner = Runner(engine, {"gen_length": 24, "block_steps": 4, "confidence_threshold": None}, max_batch=2)
    try:
        texts: dict[int, list[str]] = {}
        futures = []
        for k, prompt in enumerate(PROMPTS[:3]):
            prepared = runner.prepare(Request("r", k, prompt=prompt, params={"seed": k}))
            futures.append(runner.stream(prepared, lambda text, k=k: texts.setdefault(k, []).append(text)))
        answers = [f.result(120) for f in futures]
    finally:
        runner.close()
    for k, prompt in enumerate(PROMPTS[:3]):
        ids, params = engine.encode_prompt(prompt), runner.base.with_(seed=k)
        out, _ = alone(engine, ids, params, k)
        canvases = [engine.finish(out[: 8 * (j + 1)], (), ids)[0] for j in range(3)]
        assert texts[k] == canvases[: len(texts[k])] and len(texts[k]) >= 2
        assert answers[k].text == canvases[-1]


def test_the_default_noise_is_keyed_by_canvas_then_step(engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """docs/determinism.md: (row seed, canvas, step). Two canvases of six steps each: every draw's key is a
    canvas index first (0 or 1), then a step (up to 5), never the other way round."""
    keys: list[tuple[int, int]] = []
    at = RowNoise.at

    def recording(self, rows, block, step):  # type: ignore[no-untyped-def]
        keys.append((block, step))
        return at(self, rows, block, step)

    monkeypatch.setattr(RowNoise, "at", recording)
    settings = {"gen_length": 8, "block_length": 4, "block_steps": 6, "confidence_threshold": None}
    engine.decode_ids([engine.encode_prompt("hello there")], engine.params({**settings, "temperature": 1.0}))
    assert {c for c, _ in keys} == {0, 1}
    assert max(s for _, s in keys) >= 4
