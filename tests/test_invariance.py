"""The batch-invariant mode (`deterministic`, on by default): in bfloat16, a row's logits and answer do not
depend on its batch mates, their number or their padding, on every architecture; off, the plain kernels'
rounding does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch import invariant
from celeris_cli.engine import Engine, embedded_models
from celeris_cli.measure.invariance import deterministic_cost, mixed_prompts

from .conftest import LogitsFake

DATA = Path(__file__).parent / "data"
PROMPTS = [
    "床前明月光，",
    "The quick brown fox jumps over",
    "春眠不觉晓，处处闻啼鸟。夜来",
    "To be",
    "Shall I compare thee to a summer's day?",
    "白日依山尽，",
    "def add(a, b):\n",
]


def _shipped(folder: Path, embedded: str | None, sampling: dict[str, object]) -> Engine:
    """The model in bfloat16 with an embedded model's shipped generation defaults (the LLaDA layouts), or
    its own defaults with `sampling` on top (Dream, LLaDA2: their test checkpoints ship greedy settings)."""
    e = load_engine(folder, device="cpu", dtype="bfloat16")
    if embedded is not None:
        raw = json.loads((embedded_models()[embedded] / "generation_config.json").read_text(encoding="utf-8"))
        return Engine(e.model, e.tokenizer, e.device, e.dtype, None, e.arch).with_defaults(
            {**raw, "deterministic": True}
        )
    return Engine(e.model, e.tokenizer, e.device, e.dtype, None, e.arch).with_defaults(
        {**sampling, "deterministic": True}
    )


@pytest.fixture(scope="module", params=["llada", "llada_block", "dream", "llada2_moe", "sdar", "nemotron"])
def bf16(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Engine:
    from .conftest import make_model

    name = request.param
    if name == "llada":
        return _shipped(make_model(tmp_path_factory.mktemp("llada") / "m", tiny_tokenizer), "celeris-tiny", {})
    if name == "llada_block":
        folder = make_model(tmp_path_factory.mktemp("block") / "m", tiny_tokenizer, block_causal=True)
        return _shipped(folder, "celeris-block", {})
    if name == "dream":
        return _shipped(DATA / "dream" / "dream_tiny", None, {"temperature": 1.0, "top_p": 0.95})
    if name == "sdar":
        return _shipped(DATA / "sdar" / "sdar_tiny", None, {"temperature": 1.0, "gen_length": 32})
    if name == "nemotron":
        return _shipped(DATA / "nemotron" / "nemotron_tiny", None, {"temperature": 1.0, "gen_length": 32})
    return _shipped(DATA / "llada2" / "llada2_tiny", None, {"temperature": 1.0, "gen_length": 32})


def test_every_architecture_runs_its_own_kind(bf16: Engine) -> None:
    assert bf16.dtype == torch.bfloat16 and bf16.params().deterministic
    assert bf16.params().temperature > 0  # sampled: near ties in the draws are exercised


def _rows(e: Engine, on: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each prompt's logits at its last position and over its whole canvas, decoded in one left-padded
    batch and alone (the LM head on the selected positions only, as the decoders call it)."""
    encoded = [e.encode_prompt(p) for p in PROMPTS]
    masks = e.tokenizer.mask_id
    P = max(len(x) for x in encoded) + 8
    ids = torch.tensor([[e.tokenizer.pad_id] * (P - 8 - len(x)) + x + [masks] * 8 for x in encoded])
    keys = torch.tensor([[False] * (P - 8 - len(x)) + [True] * (len(x) + 8) for x in encoded])

    def run(ids: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = (keys.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad(), invariant.enabled(on):
            h, _ = e.model.hidden(ids, pos, keys, keep_kv=False)
            return e.model.head(h[:, -1]), e.model.head(h)

    last, full = run(ids, keys)
    alone = [run(ids[i : i + 1, P - 8 - len(x) :], keys[i : i + 1, P - 8 - len(x) :]) for i, x in enumerate(encoded)]
    same_last = [torch.equal(a[0][0], last[i]) for i, a in enumerate(alone)]
    same_full = [torch.equal(a[1][0], full[i, P - 8 - len(x) :]) for i, (a, x) in enumerate(zip(alone, encoded))]
    return same_last, same_full  # type: ignore[return-value]


def test_logits_bits_of_a_row_do_not_depend_on_its_batch_in_bfloat16(bf16: Engine) -> None:
    same_last, same_full = _rows(bf16, on=True)
    assert all(same_last) and all(same_full)


def test_without_the_mode_some_row_rounds_differently_in_a_batch(bf16: Engine) -> None:
    """What the mode is for: the plain kernels round a padded, batched row otherwise than the row alone
    (here at least the LM head, whose one-row call takes a matrix-vector path)."""
    same_last, same_full = _rows(bf16, on=False)
    assert not all(same_last + same_full)


def test_answers_alone_batched_and_in_threes_are_identical_in_bfloat16(bf16: Engine) -> None:
    seeds = list(range(len(PROMPTS)))
    params = bf16.params()
    together = [r.text for r in bf16.generate(PROMPTS, params, batch_size=len(PROMPTS), seeds=seeds)]
    by_three = [r.text for r in bf16.generate(PROMPTS, params, batch_size=3, seeds=seeds)]
    alone = [bf16.generate([p], params, batch_size=1, seeds=[s])[0].text for p, s in zip(PROMPTS, seeds)]
    assert together == by_three == alone
    assert len(set(alone)) > 3


# The first 16 lines of the 3,000-request file the clock issue (60) ran: in a batch of 16 in bfloat16 the plain
# kernels changed two of these answers (r3, r4) from the request's answer alone. And 16 mixed-length openings
# of which one (a prompt of 16 tokens beside longer ones) was answered otherwise in the batch with the mode on,
# while a padding query of the causal prefill saw itself and so kept the row's padding in its attention.
OPENINGS = ["床前明月光，", "春眠不觉晓，", "白日依山尽，", "The jury said it", "To be, or not", "红豆生南国，"]
QUEUE_PROMPTS = [p + str(i) for i, p in enumerate(OPENINGS * 3)][:16]
MIXED_PROMPTS = mixed_prompts(48)[32:]


@pytest.mark.parametrize("deterministic", [None, False])
def test_the_default_model_as_shipped_answers_alone_as_in_a_batch(deterministic: bool | None) -> None:
    """Rule 2 on what users run: the embedded default with its shipped settings, in bfloat16 (what `auto`
    picks on a CPU with bfloat16), nothing asked, and with the batch-invariant mode turned off. When the
    default decoded in static batches (left padding, one attention over the furthest row's keys) the mode off
    answered two of the 16 otherwise in the batch; its running set computes each row's attention in the
    shapes it has alone (`decode.seededrun`), and on this CPU the plain kernels then answer alone too."""
    e = load_engine(None, device="cpu", dtype="bfloat16")
    params = e.params({} if deterministic is None else {"deterministic": deterministic})
    assert params.deterministic is (deterministic is None)
    for prompts in (QUEUE_PROMPTS, MIXED_PROMPTS) if deterministic is None else (QUEUE_PROMPTS,):
        seeds = list(range(len(prompts)))
        together = [r.text for r in e.generate(prompts, params, batch_size=16, seeds=seeds)]
        alone = [e.generate([p], params, batch_size=1, seeds=[s])[0].text for p, s in zip(prompts, seeds)]
        assert together == alone


class ModeProbe(LogitsFake):
    """A fake at the model boundary that records whether each forward ran batch-invariantly."""

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]
        self.cfg = cfg
        self.seen: list[bool] = []

    def __call__(self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.seen.append(invariant.active())
        return torch.zeros(*ids.shape, self.cfg.vocab_size)


@pytest.mark.parametrize("on", [True, False])
def test_the_deterministic_setting_reaches_every_forward(engine: Engine, on: bool) -> None:
    probe = ModeProbe(engine.model.cfg)
    e = Engine(probe, engine.tokenizer, engine.device, engine.dtype)  # type: ignore[arg-type]
    params = e.params({"strategy": "reference", "gen_length": 8, "denoise_steps": 4, "deterministic": on})
    e.generate(["To be", "床前明月光，"], params, batch_size=2)
    assert probe.seen and set(probe.seen) == {on}
    assert not invariant.active()  # the mode ends with the decode


def test_a_linear_row_is_computed_alike_whatever_the_number_of_rows() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(48, 32), torch.randn(40, 32)
    with invariant.enabled(True):
        whole = invariant.linear(x, w)
        assert all(
            torch.equal(invariant.linear(x[i : i + n], w), whole[i : i + n]) for i in range(8) for n in (1, 3, 5)
        )
    assert torch.equal(invariant.linear(x, w), torch.nn.functional.linear(x, w))  # off: the plain kernel


@pytest.mark.parametrize("cached", [False, True])
def test_attention_of_a_padded_row_equals_the_row_alone(cached: bool) -> None:
    """Left padding of 0..5 keys, block-causal masks included; with a cache the queries are a window at
    `start` over the whole padded canvas."""
    torch.manual_seed(1)
    B, H, L, D, pad = 6, 4, 21, 8, [0, 1, 2, 3, 5, 5]
    k, v = torch.randn(B, 2, L, D), torch.randn(B, 2, L, D)
    start, T = (13, 4) if cached else (0, L)
    q = torch.randn(B, H, T, D)
    keys = torch.tensor([[i >= p for i in range(L)] for p in pad])
    causal = torch.arange(L)[:, None] // 4 >= torch.arange(L)[None, :] // 4  # blocks of 4 see earlier ones
    for mask in (keys[:, None, None, :], keys[:, None, None, :] & causal[start : start + T][None, None]):
        with invariant.enabled(True):
            y = invariant.attention(q, k, v, mask, start, gqa=True)
            for b, p in enumerate(pad):
                qp = 0 if cached else p
                one = invariant.attention(
                    q[b : b + 1, :, qp:],
                    k[b : b + 1, :, p:],
                    v[b : b + 1, :, p:],
                    mask[b : b + 1, :, qp:, p:],
                    start - p if cached else 0,
                    True,
                )
                assert torch.equal(y[b : b + 1, :, qp:], one)


def test_invariance_cost_reports_both_modes_and_the_same_answers_at_every_batch_size(engine: Engine) -> None:
    r = deterministic_cost(engine, [1, 3], 4, {"gen_length": 8, "denoise_steps": 4, "temperature": 1.0})
    assert [row["batch_size"] for row in r["rows"]] == [1, 3]
    assert all(row["on"]["tokens_per_s"] > 0 and row["off"]["tokens_per_s"] > 0 for row in r["rows"])
    assert r["same_answers_as_batch"]["on"] == {1: 1.0, 3: 1.0}
