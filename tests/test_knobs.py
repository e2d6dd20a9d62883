"""Rule 1: an option that is accepted does what it says. For every knob each strategy honours, changing it
changes the output where it should; and every answer depends only on its request (model, prompt,
settings, seed), never on its batch mates, the batch size or its position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli.engine import Engine, embedded_models
from celeris_cli.params import PER_REQUEST, honoured

from .conftest import LogitsFake

PROMPTS = ["床前明月光，", "To be, or not to be", "白日依山尽，黄河入海流。", "The quick"]
BASE = {
    "gen_length": 16,
    "block_length": 8,
    "denoise_steps": 16,
    "temperature": 1.0,
    "cache": "none",
    "threshold": 0.9,
    "early_exit": False,
}
# knob -> a value that must change the output, starting from BASE (and its defaults)
CHANGES = {
    "gen_length": 24,
    "block_length": 4,
    "denoise_steps": 4,
    "temperature": 0.0,
    "min_p": 0.5,
    "top_p": 0.2,
    "top_k": 2,
    "remasking": "random",
    "order_temperature": 3.0,
    "cfg_scale": 2.0,
    "threshold": 0.0,
    "cache": "dual",
    "confidence": "entropy",
    "early_exit": True,
    "suffix_window": 1,
    "presence_penalty": 2.0,
    "min_tokens": 8,
    "subword_min_p": 0.9,
    "seed": 1,
    "structured_outputs": {"regex": "[a-z ]+"},
}
# knobs tested in tests/test_structured.py: logprobs and top_logprobs change what is reported about an answer,
# not its tokens; structured_layout needs a constraint beside it
REPORTS = ("logprobs", "top_logprobs", "structured_layout")


def decode(engine: Engine, strategy: str, **changes: object) -> tuple[list[list[int]], int]:
    base = {k: v for k, v in BASE.items() if k in honoured(strategy)}
    params = engine.params({**base, "strategy": strategy, **changes})
    return engine.decode_ids([engine.encode_prompt(p) for p in PROMPTS], params)


@pytest.mark.parametrize("strategy", ["reference", "fast"])
def test_the_table_covers_every_knob_the_strategy_honours(strategy: str) -> None:
    assert set(honoured(strategy)) - set(PER_REQUEST) - set(REPORTS) | {"seed"} <= set(CHANGES)


@pytest.mark.parametrize(
    ("strategy", "knob"),
    [(s, k) for s in ("reference", "fast") for k in CHANGES if k in honoured(s)],
)
def test_changing_a_knob_changes_the_output(eos_prone: Engine, strategy: str, knob: str) -> None:
    """The uncut canvas (the forward count alone would not do: guidance doubles it even when its logits are
    dropped). Early exit, for one, changes what stands after the end of text, not the cut text."""
    assert decode(eos_prone, strategy, **{knob: CHANGES[knob]})[0] != decode(eos_prone, strategy)[0]


def test_stop_strings_cut_the_answer_and_strategy_changes_the_decoder(engine: Engine) -> None:
    params = engine.params({**BASE, "temperature": 0.0})
    [free] = engine.generate(["床前明月光，"], params)
    assert len(free.text) > 2
    stop = free.text[1:3]
    [cut] = engine.generate(["床前明月光，"], params.with_(stop=[stop, "never seen"]))
    assert cut.text == free.text[: free.text.find(stop)] and cut.finish_reason == "stop"
    assert 0 < cut.output_tokens <= free.output_tokens and cut.settings["stop"] == [stop, "never seen"]
    ref = engine.params({k: v for k, v in BASE.items() if k in honoured("reference")} | {"strategy": "reference"})
    _, ref_nfe = engine.decode_ids([engine.encode_prompt(p) for p in PROMPTS], ref)
    _, fast_nfe = decode(engine, "fast", threshold=0.0)  # same knobs otherwise: the strategy picks the decoder
    assert (ref_nfe, fast_nfe) == (16, 2)


class CountingModel:
    """The real model with every forward pass at the model boundary counted."""

    logit_shift = 0

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, 0

    def hidden(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.model.hidden(*args, **kwargs)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.head(h)

    def __call__(self, ids, key_mask, positions):  # type: ignore[no-untyped-def]
        h, _ = self.hidden(ids, positions, key_mask)
        return self.head(h)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.__dict__["model"], name)


@pytest.mark.parametrize("strategy", ["reference", "fast"])
@pytest.mark.parametrize("cfg_scale", [0.0, 2.0])
def test_reported_nfe_equals_the_forward_passes_run(engine: Engine, strategy: str, cfg_scale: float) -> None:
    counting = CountingModel(engine.model)
    spy = Engine(counting, engine.tokenizer, engine.device, engine.dtype)  # type: ignore[arg-type]
    base = {k: v for k, v in BASE.items() if k in honoured(strategy)}
    results = spy.generate(PROMPTS, spy.params({**base, "strategy": strategy, "cfg_scale": cfg_scale}), batch_size=4)
    # a row's nfe counts the forwards it took part in; the row that finishes last (all start together,
    # guided or not: a guided fast row's two views share each packed forward) took part in every one
    assert max(r.nfe for r in results) == counting.calls > 0
    if strategy == "reference":  # a fixed schedule: guidance doubles the passes exactly
        assert counting.calls == 16 * (2 if cfg_scale else 1)


def test_guidance_changes_greedy_text_in_the_default_strategy(engine: Engine) -> None:
    greedy = engine.params({"gen_length": 16, "block_length": 8, "denoise_steps": 16, "temperature": 0.0})
    assert greedy.strategy == "fast"
    plain = [r.text for r in engine.generate(PROMPTS, greedy)]
    guided = [r.text for r in engine.generate(PROMPTS, greedy.with_(cfg_scale=2.0))]
    assert plain != guided


def shipped(e: Engine) -> Engine:
    """A tiny model with celeris-tiny's shipped generation defaults (temperature 1.2, order noise, early exit;
    poems one commit per step with the prefix cache and a suffix window of 16, English threshold commits),
    in float32."""
    raw = json.loads((embedded_models()["celeris-tiny"] / "generation_config.json").read_text(encoding="utf-8"))
    return Engine(e.model, e.tokenizer, e.device, e.dtype, None).with_defaults(raw)


TWENTY = [
    "床前明月光，",
    "白日依山尽，",
    "春眠不觉晓，处处闻啼鸟。",
    "To be",
    "Shall I compare thee to a summer's day?",
    "The quick brown fox",
    "举头望明月，",
    "欲穷千里目，更上一层楼。",
    "夜来风雨声，",
    "花落知多少",
    "That is the question.",
    "Thou art more lovely",
    "jumps over the lazy dog near the river bank.",
    "床",
    "黄河入海流。",
    "or not to be: that is",
    "低头思故乡。",
    "more temperate",
    "春",
    "The",
]


@pytest.mark.parametrize(  # (the rows that end early and leave are the fast decoder's: reference runs every step)
    ("model", "strategy"), [("engine", "fast"), ("eos_prone", "fast"), ("engine", "reference")]
)
def test_an_answer_does_not_depend_on_batch_mates_or_batch_size(
    request: pytest.FixtureRequest, model: str, strategy: str
) -> None:
    e = shipped(request.getfixturevalue(model))
    params = e.params({"seed": 11} if strategy == "fast" else {"seed": 11, "strategy": "reference"})
    assert params.temperature > 0 and (strategy == "reference" or params.order_temperature > 0)
    results = e.generate(TWENTY, params, batch_size=20)
    together = [r.text for r in results]
    by_three = [r.text for r in e.generate(TWENTY, params, batch_size=3)]
    alone = [e.generate([p], params, batch_size=1)[0].text for p in TWENTY]
    assert together == alone == by_three
    assert len(set(alone)) > 10  # sampled, varied answers: the property is not trivially true
    if model == "eos_prone" and strategy == "fast":  # rows end in the first block and leave the batch (early
        lengths = [r.output_tokens for r in results]  # exit) while a mate decodes on into the next one
        assert min(lengths) < params.block_length <= max(lengths)
    reversed_batch = [r.text for r in e.generate(TWENTY[::-1], params, batch_size=20)]
    assert reversed_batch[::-1] == alone  # the position in the batch does not matter either


def test_samples_draw_different_answers_and_each_is_its_own_seed(engine: Engine) -> None:
    e = shipped(engine)
    params = e.params({"seed": 5})
    samples = e.generate(["床前明月光，"] * 4, params, seeds=[5, 6, 7, 8])
    assert len({r.text for r in samples}) > 1
    assert [r.seed for r in samples] == [5, 6, 7, 8]
    assert samples[2].text == e.generate(["床前明月光，"], params.with_(seed=7))[0].text


def padded(e: Engine, prompts: list[str], params: object, seeds: list[int]) -> list[str]:
    """The answers of one left-padded batch through the fast decoder (`generate_fast`) itself."""
    from celeris_cli.decode.sampling import RowNoise, request_seed
    from celeris_cli.decode.strategies import Net, get_strategy

    encoded = [e.encode_prompt(p) for p in prompts]
    P = max(map(len, encoded))
    prompt = torch.tensor([[e.tokenizer.pad_id] * (P - len(ids)) + ids for ids in encoded])
    mask = torch.tensor([[False] * (P - len(ids)) + [True] * len(ids) for ids in encoded])
    noise = RowNoise([request_seed(s, ids) for s, ids in zip(seeds, encoded)], e.device)
    out = get_strategy("fast")(Net(e.model), prompt, mask, params, e.special, noise)  # type: ignore[arg-type]
    return [e.finish(out[b, P:].tolist(), params.stop, ids)[0] for b, ids in enumerate(encoded)]  # type: ignore[attr-defined]


def test_bfloat16_batched_answers_equal_alone_with_float32_attention_and_logits(tiny_model: Path) -> None:
    """With the plain kernels (`deterministic` off), bfloat16 rounding depends on the padded shape; with
    attention and logits in float32 (the default, `upcast`), batched answers still equal their alone ones
    here, and without it they measurably drift: the upcast is what holds them together."""
    from celeris_cli import load_engine
    from celeris_cli.measure.bench import agreement

    e = load_engine(tiny_model, device="cpu", dtype="bfloat16")
    base = {"gen_length": 24, "block_length": 8, "denoise_steps": 24, "temperature": 1.0, "deterministic": False}
    seeds = list(range(len(TWENTY)))

    def identical() -> float:  # over the three cache modes: which of them drifts depends on the draws
        shares = []
        for cache in ("dual", "prefix", "none"):
            params = e.params({**base, "cache": cache})
            # left-padded batches (the fast decoder's static path, guidance's): the running set's rows attend
            # over exactly their own keys
            together = padded(e, TWENTY, params, seeds)
            alone = [e.generate([p], params, seeds=[s])[0].text for p, s in zip(TWENTY, seeds)]
            shares.append(agreement(alone, together)["identical_rows"])
        return sum(shares) / len(shares)

    with_upcast = identical()
    e.model.set_upcast(False)
    assert with_upcast >= 0.95 and identical() < with_upcast


class FlatModel(LogitsFake):
    """A fake at the model boundary whose logits are all equal: what gets sampled is the noise alone."""

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]
        self.cfg = cfg

    def __call__(self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.cfg.vocab_size)


def test_prompts_sharing_a_seed_do_not_share_their_noise(engine: Engine) -> None:
    """A thousand prompts run with the default seed must not all draw the same noise, or their answers
    become alike; the prompt is part of each row's stream, so (prompt, seed) still fixes the answer."""
    flat = Engine(FlatModel(engine.model.cfg), engine.tokenizer, engine.device, engine.dtype)  # type: ignore[arg-type]
    params = flat.params({"strategy": "reference", "gen_length": 8, "block_length": 8, "denoise_steps": 8,
                          "temperature": 1.0, "seed": 3})  # fmt: skip
    a, b = flat.encode_prompt("床前"), flat.encode_prompt("白日")
    outs, _ = flat.decode_ids([a, b], params)
    assert outs[0] != outs[1]
    again, _ = flat.decode_ids([b, a], params)
    assert again == outs[::-1]  # and each is still a function of its own request


@pytest.mark.parametrize("strategy", ["reference", "fast"])
@pytest.mark.parametrize("remasking", ["sequential", "low_confidence"])
def test_sequential_remasking_fills_the_canvas_left_to_right(engine: Engine, strategy: str, remasking: str) -> None:
    """One token a step: under `sequential` every canvas a forward sees has its masks as a suffix of the
    answer (SDAR's sequential; its reference cases are in tests/test_sdar.py); by confidence it does not."""
    counting = CountingModel(engine.model)
    seen: list[torch.Tensor] = []
    hidden = counting.hidden

    def record(ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(ids.clone())
        return hidden(ids, *args, **kwargs)

    counting.hidden = record  # type: ignore[method-assign]
    spy = Engine(counting, engine.tokenizer, engine.device, engine.dtype)  # type: ignore[arg-type]
    base = {k: v for k, v in BASE.items() if k in honoured(strategy)} | {"threshold": 1.0, "early_exit": False}
    settings = {**base, "strategy": strategy, "denoise_steps": 16, "remasking": remasking}
    prompts = [spy.encode_prompt(p) for p in PROMPTS]
    spy.decode_ids(prompts, spy.params({k: v for k, v in settings.items() if k in {*honoured(strategy), "strategy"}}))
    mask = engine.tokenizer.mask_id
    answers = [ids[:, -16:] == mask for ids in seen if ids.shape[1] >= 16 and bool((ids == mask).any())]
    in_order = all(bool((m.int().diff(dim=1) >= 0).all()) for m in answers)  # masked never before a filled one
    assert answers and in_order == (remasking == "sequential")


def test_sequential_remasking_turns_the_threshold_off_and_refuses_one_asked_for(engine: Engine) -> None:
    from celeris_cli.errors import UsageError

    assert engine.params({"strategy": "fast"}).threshold < 1  # the defaults' threshold
    assert engine.params({"strategy": "fast", "remasking": "sequential"}).threshold == 1.0  # is off
    with pytest.raises(UsageError, match="threshold: sequential remasking commits the leftmost masked positions"):
        engine.params({"strategy": "fast", "remasking": "sequential", "threshold": 0.9})
    with pytest.raises(UsageError, match="order_temperature: sequential remasking commits in an order of its own"):
        engine.params({"strategy": "fast", "remasking": "sequential", "order_temperature": 1.0})
