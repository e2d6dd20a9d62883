"""Self-speculative decoding (`spec`, the default model's exact left-to-right mode) against oracles that share
none of its code, and against itself under schedules a test forces (`drafting: random:SEED`).

- A plain left-to-right loop written here: the whole sequence through the model every token, no cache, no
  rows, no running set; greedy `spec` must give its tokens, and its log probabilities must be a softmax
  computed here.
- The same requests decoded alone with `drafting: never` (the AR mode, one token a forward): every answer of
  a random mix (prompt and answer lengths, draft widths, samplers, seeds), decoded under random drafting
  schedules, random batch mates, random widths and admission orders, through the running set and in static
  batches, must equal it token for token, greedy and sampled, in float32 (docs/determinism.md).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.decode import selfspec
from celeris_cli.decode.sampling import RowNoise, request_seed
from celeris_cli.decode.strategies import Net, get_strategy
from celeris_cli.errors import UsageError

from .conftest import decoded_alone

PROMPTS = ["The old man", "It was late", "床前明月光，", "The river", "At night", "She opened the door", "白日依山尽，"]
LONG = "The jury said it was late and the old man opened the door to the river at night, " * 2


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    engine = load_engine(None, device="cpu", dtype="float32")  # the default model, decoded by its `spec`
    assert engine.model_dir is not None
    config = json.loads((engine.model_dir / "generation_config.json").read_text(encoding="utf-8"))
    return engine.with_defaults({**config, "strategy": "spec"})


def _plain_loop(model: Any, prompt: list[int], n: int, stops: frozenset[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy left to right: each token the argmax of the AR mode's logits after the whole sequence so far,
    recomputed from scratch (a causal mask over every position, no cache). Returns the tokens (up to the first
    stop token, kept) and the logits each was chosen from."""
    ids, logits = list(prompt), []
    for _ in range(n):
        T = len(ids)
        x = torch.tensor([ids])
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        h, _ = model.hidden(x, torch.arange(T)[None], causal, None, 0, False)
        last = model.head(h[:, -1]).double()[0]
        logits.append(last)
        ids.append(int(last.argmax()))
        if ids[-1] in stops:
            break
    return ids[len(prompt) :], logits


def _static(engine: Any, prompts: list[list[int]], params: Any, seeds: list[int]) -> list[list[int]]:
    """A static batch (left-padded) by the strategy's own decoder, called directly: each row's ids (uncut)."""
    P = max(len(p) for p in prompts)
    x = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    noise = RowNoise([request_seed(s, p) for s, p in zip(seeds, prompts)], x.device)
    out = get_strategy(params.strategy)(Net(engine.model), x, mask, params, engine._special(params), noise)
    return out[:, P:].tolist()  # type: ignore[no-any-return]


def _cut(ids: list[int], stops: frozenset[int]) -> list[int]:
    """ids up to and including the first stop token."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


@pytest.mark.parametrize("drafting", ["never", "always", "random:3"])
def test_greedy_spec_is_a_plain_left_to_right_loop(engine, drafting) -> None:  # type: ignore[no-untyped-def]
    n = 24
    params = engine.params({"gen_length": n, "temperature": 0.0, "denoise_steps": 6, "drafting": drafting})
    stops = engine._special(params).stop_ids
    prompts = [engine.encode_prompt(p) for p in (*PROMPTS[:4], LONG)]
    got, _ = engine.decode_ids(prompts, params)  # through the running set
    with torch.no_grad():
        want = [_plain_loop(engine.model, p, n, stops)[0] for p in prompts]
    assert [_cut(g, stops) for g in got] == want
    static = _static(engine, prompts, params, [0] * len(prompts))  # a static batch, left-padded
    assert [_cut(g, stops) for g in static] == want


def test_log_probabilities_are_a_softmax_of_the_ar_modes_logits(engine) -> None:  # type: ignore[no-untyped-def]
    n = 12
    params = engine.params(
        {"gen_length": n, "temperature": 0.0, "denoise_steps": 4, "drafting": "always", "logprobs": True,
         "top_logprobs": 2}
    )  # fmt: skip
    stops = engine._special(params).stop_ids
    prompts = [engine.encode_prompt(p) for p in PROMPTS[:3]]
    rules = [engine.rule_for(params) for _ in prompts]
    got, _ = engine.decode_ids(prompts, params, rules=rules)
    checked = 0
    for prompt, ids, rule in zip(prompts, got, rules):
        with torch.no_grad():
            tokens, logits = _plain_loop(engine.model, prompt, n, stops)
        assert _cut(ids, stops) == tokens
        for t, (token, scores) in enumerate(zip(tokens, logits)):
            z = scores.double()
            logp = (z - z.max() - (z - z.max()).exp().sum().log()).tolist()  # the softmax, written out here
            best = sorted(range(len(logp)), key=lambda i: -logp[i])[:2]
            got_token, got_logp, top = rule.record.at[t]
            assert got_token == token
            assert got_logp == pytest.approx(logp[token], abs=1e-4)
            assert [i for i, _ in top] == best
            assert [v for _, v in top] == pytest.approx([logp[i] for i in best], abs=1e-4)
            checked += 1
    assert checked >= 20


SAMPLERS = ({"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}, {})  # greedy, nucleus, the defaults


def _mix(engine: Any, rng: random.Random, n: int) -> list[tuple[str, Any, int]]:
    """n requests: prompts short and long, answers of 1 to 20 tokens, draft widths 1 to 10, three samplers
    (the defaults with each prompt's script preset: presence penalty, min_tokens, subword min-p), seeds."""
    out = []
    for _ in range(n):
        prompt = rng.choice([*PROMPTS, LONG])
        gen = rng.choice([1, 3, 8, 12, 16, 20])
        layer = {**rng.choice(SAMPLERS), "gen_length": gen, "denoise_steps": rng.randint(max(1, gen // 10), gen)}
        out.append((prompt, engine.params_for(prompt, engine.params(layer)), rng.randrange(1000)))
    return out


def _never_alone(engine: Any, requests: list[tuple[str, Any, int]]) -> list[list[int]]:
    """Each request alone, by the strategy's own decoder called directly, one token a forward."""
    stops = engine._special(requests[0][1]).stop_ids
    return [_cut(decoded_alone(engine, p, replace(q, drafting="never"), s), stops) for p, q, s in requests]


def test_answers_equal_never_alone_under_random_schedules_batch_mates_and_admissions(engine) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(2026)
    requests = _mix(engine, rng, 12)
    assert len({p.part("drafting").width for _, p, _ in requests}) >= 4  # rows of many draft widths share lanes
    want = _never_alone(engine, requests)
    stops = engine._special(requests[0][1]).stop_ids
    drafted = engine.drafted
    for trial in range(3):
        schedule = f"random:{rng.randrange(10**6)}"
        order = rng.sample(range(len(requests)), len(requests))  # admission order
        rows = [(requests[i][0], replace(requests[i][1], drafting=schedule), requests[i][2]) for i in order]
        width = rng.randint(2, 6)
        got = engine.decode_running(
            [p for p, _, _ in rows], [engine.encode_prompt(p) for p, _, _ in rows], [q for _, q, _ in rows],
            [s for _, _, s in rows], width, refill=trial != 1,
        )  # fmt: skip
        texts = {i: r.text for i, r in zip(order, got)}
        for i, (prompt, params, _) in enumerate(requests):
            alone = engine.finish(want[i], params.stop, engine.encode_prompt(prompt), params.stop_token_ids)[0]
            assert texts[i] == alone, (trial, schedule, i, prompt, params.temperature, params.part("drafting").width)
    assert engine.drafted > drafted  # the schedules drafted
    # static batches of random mates under random schedules, by the strategy's decoder itself
    for _ in range(2):
        settings = replace(rng.choice(requests)[1], drafting=f"random:{rng.randrange(10**6)}")
        mates = [(rng.choice([*PROMPTS, LONG]), settings, rng.randrange(1000)) for _ in range(4)]
        ids = [engine.encode_prompt(p) for p, _, _ in mates]
        got_ids = _static(engine, ids, settings, [s for _, _, s in mates])
        assert [_cut(g, stops) for g in got_ids] == _never_alone(engine, mates)


def test_mixed_answer_lengths_and_draft_widths_through_one_running_set(engine) -> None:  # type: ignore[no-untyped-def]
    """Issue 53's crash: one long prompt with a short answer (draft width 1, the lane's longest canvas) beside
    short prompts with long answers and wider drafts, in one lane (one sampler); a drafting round pads every
    row to the widest row's columns, which must fit the long row's canvas near its end."""
    short = (("The old man", 24, 3), ("It was late", 40, 5), ("The river", 64, 8), ("At night", 32, 4))
    layers = [(LONG * 3, 16, 16), *short]
    # each sampler beside one schedule (all four pairs took 15 s)
    for sampler, drafting in (({"temperature": 0.0}, "always"), ({"temperature": 0.9, "min_tokens": 20}, "random:11")):
        settings = [engine.params({**sampler, "gen_length": g, "denoise_steps": s, "drafting": drafting})
                    for _, g, s in layers]  # fmt: skip
        requests = [(p, q, 7 + i) for i, ((p, _, _), q) in enumerate(zip(layers, settings))]
        got = engine.decode_running(
            [p for p, _, _ in requests], [engine.encode_prompt(p) for p, _, _ in requests],
            [q for _, q, _ in requests], [s for _, _, s in requests], 5,
        )  # fmt: skip
        assert engine.last_occupancy is not None and engine.last_occupancy.forwards == engine.last_occupancy.rounds
        want = _never_alone(engine, requests)
        for r, (prompt, params, _), ids in zip(got, requests, want):
            assert r.text == engine.finish(ids, params.stop, engine.encode_prompt(prompt))[0]


@pytest.mark.parametrize("bad", ["random", "random:", "random:x", "random:-1", "Random:1", "random:1.5", "sometimes"])
def test_a_drafting_schedule_that_is_not_one_is_refused_by_name(engine, bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="drafting.*random:SEED"):
        engine.params({"drafting": bad})


def test_a_random_schedule_drafts_some_rounds_and_not_others(engine) -> None:  # type: ignore[no-untyped-def]
    """The coin decides: some rounds draft, some do not, and another seed gives another schedule (more forwards
    or fewer, never another answer)."""
    prompts = [engine.encode_prompt(p) for p in PROMPTS[:3]]
    counts = {}
    for drafting in ("never", "always", "random:1", "random:2"):
        params = engine.params({"gen_length": 24, "temperature": 0.0, "denoise_steps": 4, "drafting": drafting})
        before = engine.drafted
        out, forwards = engine.decode_ids(prompts, params)
        counts[drafting] = (engine.drafted - before, forwards, out)
    assert counts["never"][0] == 0 < counts["random:1"][0] < counts["always"][0]
    assert len({c[1] for c in counts.values()}) > 2  # the schedules differ in forwards
    assert len({str(c[2]) for c in counts.values()}) == 1  # and in nothing else


def test_a_positions_logits_are_the_same_bits_whatever_the_schedule(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The logits each answer token is drawn from, by (stream, position) key, under `never`, `always` and a
    random schedule, in a batch: equal bit for bit (a difference of one rounding moves a sampled token now
    and then, which no answer-level test of this size would meet)."""
    seen: dict[int, torch.Tensor] = {}
    guessing = [False]
    choose, guesser = selfspec.choose, selfspec.SpecRows._guesser

    def recording(logits, places, s, confidence, draws, chunk):  # type: ignore[no-untyped-def]
        if not guessing[0]:  # the diffusion mode's guesses draw with the same keys from other logits
            for key, row in zip(draws.keys.tolist(), logits(slice(0, len(places)))):
                seen[key] = row.clone()
        return choose(logits, places, s, confidence, draws, chunk)

    def guessing_(self, *args):  # type: ignore[no-untyped-def]
        guessing[0] = True
        try:
            return guesser(self, *args)
        finally:
            guessing[0] = False

    monkeypatch.setattr(selfspec, "choose", recording)
    monkeypatch.setattr(selfspec.SpecRows, "_guesser", guessing_)
    prompts = [engine.encode_prompt(p) for p in (PROMPTS[0], PROMPTS[2], LONG)]
    runs = {}
    for drafting in ("never", "always", "random:5"):
        seen.clear()
        params = engine.params({"gen_length": 16, "temperature": 1.0, "denoise_steps": 4, "drafting": drafting})
        engine.decode_ids(prompts, params, seeds=[1, 2, 3])
        runs[drafting] = dict(seen)
    shared = runs["never"].keys() & runs["always"].keys() & runs["random:5"].keys()
    assert len(shared) >= 30
    for key in shared:
        assert torch.equal(runs["never"][key], runs["always"][key])
        assert torch.equal(runs["never"][key], runs["random:5"][key])


def test_rows_that_differ_in_sampler_share_a_forward_and_an_empty_lane_is_given_back(engine) -> None:  # type: ignore[no-untyped-def]
    """A lane is a forward's shape: rows of four temperatures and two shapings (the script presets) run in one
    lane a drafting policy, one forward a round; a lane whose rows have all left holds no cache; every answer
    is its own alone."""
    prompts = ["The old man", "床前明月光，", "It was late", "白日依山尽，", "The river", "At night"]
    temperatures, policies = (0.0, 0.7, 0.9, 1.0, 0.7, 0.0), ["always"] * 4 + ["never"] * 2
    settings = [
        engine.params_for(p, engine.params({"gen_length": g, "temperature": t, "drafting": d, "denoise_steps": 4}))
        for p, g, t, d in zip(prompts, (8, 20, 12, 6, 16, 10), temperatures, policies)
    ]
    assert len({(q.part("sampling"), q.part("shaping")) for q in settings}) >= 4
    scheduler, _ = engine._scheduler(settings, 6)
    scheduler.add(engine._request(i, engine.encode_prompt(p), q, 5) for i, (p, q) in enumerate(zip(prompts, settings)))
    got, lanes_seen = {}, []
    for key, out, _ in scheduler.run():
        got[key] = out
        lanes_seen.append(len(scheduler.lanes))
        assert all(len(lane.idx) for lane in scheduler.lanes.values())  # no lane held empty
    assert max(lanes_seen) == 2  # one per drafting policy, whatever the samplers
    assert scheduler.occupancy.forwards <= 2 * scheduler.occupancy.rounds
    assert not scheduler.lanes and not scheduler.noise.seeds  # nothing kept once every row has left
    requests = list(zip(prompts, settings, [5] * len(prompts)))
    stops = engine._special(settings[0]).stop_ids
    assert [_cut(got[i], stops) for i in range(len(prompts))] == _never_alone(engine, requests)


def test_batch_files_under_different_schedules_and_batch_sizes_are_the_same_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`celeris batch` over 36 requests (the default model and dtype), drafting one token a round sixteen at a
    time, and with `never` three at a time: the same answers, request for request."""
    scripts = ["床前明月光，", "春眠不觉晓，", "白日依山尽，", "The jury said it", "To be, or not", "红豆生南国，"]
    lines = [{"custom_id": f"r{i}", "prompt": scripts[i % 6] + str(i), "seed": i % 3} for i in range(36)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), "utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    answers = []
    for name, drafting, batch in (("a", "random:1", 16), ("c", "never", 3)):
        settings = json.dumps({"strategy": "spec", "drafting": drafting, "gen_length": 16, "denoise_steps": 4})
        args = ["batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / f"{name}.jsonl"), "--device", "cpu"]
        args += ["--set", settings, "--batch-size", str(batch)]
        done = subprocess.run([sys.executable, "-m", "celeris_cli", *args], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr
        rows = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text("utf-8").splitlines()]
        answers.append({r["custom_id"]: (r["response"]["body"]["text"], r["response"]["body"]["finish_reason"])
                        for r in rows})  # fmt: skip
    assert len(answers[0]) == 36
    assert answers[0] == answers[1]
