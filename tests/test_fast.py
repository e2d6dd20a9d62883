"""Fast decoding: threshold commits, KV cache exactness where it must be exact, early exit, batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.kv import KVCache
from celeris_cli.decode.fast import FastPlan, generate_fast
from celeris_cli.decode.reference import finished_rows
from celeris_cli.decode.strategies import Net
from celeris_cli.engine import Engine

from .conftest import make_model, noise, plan

PROMPTS = [
    "床前明月光，",
    "To be, or not to be: that is the question. Shall I compare thee",
    "白日依山尽，黄河入海流。",
    "The quick",
    "春",
]
MODES = [
    {"strategy": "reference"},
    {"strategy": "fast", "cache": "none", "early_exit": False},
    {"strategy": "fast", "cache": "prefix"},
    {"strategy": "fast", "cache": "dual"},
    {"strategy": "fast", "cache": "dual", "confidence": "margin", "threshold": 0.5},
    {"strategy": "fast", "cache": "none", "confidence": "entropy", "threshold": 0.3},
    {"strategy": "fast", "cache": "prefix", "confidence": "lead", "threshold": 0.6},
    {"strategy": "fast", "cache": "dual", "suffix_window": 4},
    {"strategy": "fast", "cache": "prefix", "suffix_window": 8},
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_batch_versus_alone_equality_in_every_mode(engine: Engine, mode: dict) -> None:
    params = engine.params({"gen_length": 24, "block_length": 8, "denoise_steps": 24, **mode})
    encoded = [engine.encode_prompt(p) for p in PROMPTS]
    together, _ = engine.decode_ids(encoded, params)
    for ids, row in zip(encoded, together):
        alone, _ = engine.decode_ids([ids], params)
        assert alone[0] == row


class Recorder(Net):
    """The real model, with every full-canvas input recorded and the rows of every call counted."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model)
        self.canvases: list[torch.Tensor] = []
        self.row_passes = 0
        self.cached_calls = 0
        self.kept: list[int] = []  # layers' keys/values returned by each full-canvas forward

    def hidden(self, ids, positions, key_mask, cache=None, start=0, keep_kv=True):  # type: ignore[no-untyped-def]
        if cache is None:
            self.canvases.append(ids.clone())
            h, kv = super().hidden(ids, positions, key_mask, cache, start, keep_kv)
            self.kept.append(len(kv))
            self.row_passes += ids.shape[0]
            return h, kv
        else:
            self.cached_calls += 1
        self.row_passes += ids.shape[0]
        return super().hidden(ids, positions, key_mask, cache, start, keep_kv)


def run_fast(engine: Engine, prompts: list[str], params: FastPlan) -> tuple[torch.Tensor, Recorder, int]:
    encoded = [engine.encode_prompt(p) for p in prompts]
    P = max(map(len, encoded))
    prompt = torch.tensor([[engine.tokenizer.pad_id] * (P - len(i)) + i for i in encoded])
    pmask = torch.tensor([[False] * (P - len(i)) + [True] * len(i) for i in encoded])
    net = Recorder(engine.model)
    out = generate_fast(
        net, prompt, pmask, params, engine.tokenizer.mask_id, engine.tokenizer.stop_ids, noise(len(prompts))
    )
    return out, net, P


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_a_full_forward_keeps_the_layers_keys_and_values_only_for_a_cache(engine: Engine, cache: str) -> None:
    """Without a cache nothing uses them, so no forward holds every layer's keys and values at once."""
    params = plan("fast", gen_length=16, block_length=8, denoise_steps=16, cache=cache, early_exit=False)
    out, net, _ = run_fast(engine, PROMPTS, params)
    layers = engine.model.cfg.n_layers
    assert net.kept and set(net.kept) == ({0} if cache == "none" else {layers})
    ids = out[:, :12]
    h, kv = engine.model.hidden(ids)
    h2, none = engine.model.hidden(ids, keep_kv=False)
    assert torch.equal(h, h2) and len(kv) == layers and none == []


@pytest.mark.parametrize("threshold", [0.0, 0.3, 1.0])
def test_threshold_commits_at_least_one_per_row_per_step_and_never_touches_the_prompt(
    engine: Engine, threshold: float
) -> None:
    mask = engine.tokenizer.mask_id
    params = plan(
        "fast", gen_length=16, block_length=16, denoise_steps=16, threshold=threshold, cache="none", early_exit=False
    )
    out, net, P = run_fast(engine, PROMPTS, params)
    prompt = out[:, :P]
    assert not (out == mask).any() and torch.equal(net.canvases[0][:, :P], prompt)
    for before, after in zip(net.canvases, net.canvases[1:]):
        assert torch.equal(after[:, :P], prompt)
        newly = ((before == mask) & (after != mask)).sum(1)
        still_masked = (before == mask).any(1)
        assert (newly[still_masked] >= 1).all()
    if threshold == 0.0:  # everything clears a zero threshold: the block is done in one step
        assert len(net.canvases) == 1
    if threshold == 1.0:  # nothing clears it: one commit per step, like the reference schedule
        assert len(net.canvases) == 16


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Engine:
    folder = make_model(tmp_path_factory.mktemp("one") / "m", tiny_tokenizer, n_layers=1, seed=4)
    return load_engine(folder, device="cpu", dtype="float32")


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_is_exact_for_a_one_layer_model(one_layer: Engine, cache: str) -> None:
    """With one layer, keys/values depend only on each position's own token, so a cache refreshed per
    block and spliced with fresh block (and suffix) values must reproduce uncached decoding exactly."""
    base = {"gen_length": 24, "block_length": 8, "denoise_steps": 24, "threshold": 0.95, "early_exit": False}
    encoded = [one_layer.encode_prompt(p) for p in PROMPTS]
    plain, nfe_plain = one_layer.decode_ids(encoded, one_layer.params({**base, "cache": "none"}))
    cached, nfe_cached = one_layer.decode_ids(encoded, one_layer.params({**base, "cache": cache}))
    assert cached == plain and nfe_cached == nfe_plain


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_cached_call_reproduces_the_full_forward_when_the_canvas_is_unchanged(engine: Engine, cache: str) -> None:
    """At any depth: right after a refresh, recomputing the block (dual) or block and suffix (prefix) against
    the cache gives the full forward's hidden states there. This pins the cache splice (in-place update at
    `start`, positions, key mask) on a two-layer model; what stays approximate is only that the cached part
    is not recomputed after later commits."""
    net = Net(engine.model)
    encoded = [engine.encode_prompt(p) for p in PROMPTS]
    P, G = max(map(len, encoded)), 16
    ids = torch.tensor([[engine.tokenizer.pad_id] * (P - len(i)) + i + [engine.tokenizer.mask_id] * G for i in encoded])
    km = torch.tensor([[False] * (P - len(i)) + [True] * (len(i) + G) for i in encoded])
    pos = Net.positions(km)
    full, kv = net.hidden(ids, pos, km)
    cache_kv = KVCache([(k.contiguous(), v.contiguous()) for k, v in kv]).view()
    s, e = P + 8, P + 12
    end = ids.shape[1] if cache == "prefix" else e
    part, _ = net.hidden(ids[:, s:end], pos[:, s:end], km, cache_kv, s)
    assert torch.allclose(part, full[:, s:end], atol=1e-5)


def test_decoding_with_several_steps_per_block_runs_the_cached_branch(engine: Engine) -> None:
    out, net, _ = run_fast(
        engine, PROMPTS, plan("fast", gen_length=16, block_length=8, denoise_steps=16, threshold=1.0)
    )
    assert net.cached_calls > 0 and len(net.canvases) == 2  # one refresh per block, cached steps in between


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_early_exit_keeps_every_row_equal_and_saves_forward_passes(eos_prone: Engine, cache: str) -> None:
    base = {"gen_length": 32, "block_length": 8, "denoise_steps": 32, "threshold": 0.9, "cache": cache}
    prompts = PROMPTS * 2
    without = eos_prone.generate(prompts, eos_prone.params({**base, "early_exit": False}), batch_size=10)
    with_exit = eos_prone.generate(prompts, eos_prone.params({**base, "early_exit": True}), batch_size=10)
    assert [r.text for r in with_exit] == [r.text for r in without]
    assert [r.finish_reason for r in with_exit] == [r.finish_reason for r in without]
    stopped = sum(r.finish_reason == "stop" for r in without)
    assert 0 < stopped  # the property is exercised: some rows do end early
    # finished rows leave the batch: fewer row-forwards for the same outputs
    fast = plan("fast", **{**base, "early_exit": True})
    slow = plan("fast", **{**base, "early_exit": False})
    _, net_fast, _ = run_fast(eos_prone, prompts, fast)
    _, net_slow, _ = run_fast(eos_prone, prompts, slow)
    assert net_fast.row_passes < net_slow.row_passes


def test_finished_rows_needs_everything_before_the_stop_token_decoded() -> None:
    M, S = 4, 2
    gen = torch.tensor([[7, S, M], [M, S, 7], [7, 8, 9], [S, M, M]])
    done, first = finished_rows(gen, M, torch.tensor([S]))
    assert done.tolist() == [True, False, False, True]
    assert first.tolist() == [1, 1, 3, 0]


@pytest.mark.parametrize(
    "bad", [{"threshold": 1.5}, {"cache": "triple"}, {"confidence": "vibes"}, {"early_exit": "yes"}]
)
def test_fast_parameters_are_validated(engine: Engine, bad: dict) -> None:
    from celeris_cli.errors import UsageError

    with pytest.raises(UsageError):
        engine.params(bad)


class RowCounter(Recorder):
    """Records how many rows each forward (full or cached) computes, in call order."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model)
        self.rows: list[int] = []

    def hidden(self, ids, positions, key_mask, cache=None, start=0, keep_kv=True):  # type: ignore[no-untyped-def]
        self.rows.append(ids.shape[0])
        return super().hidden(ids, positions, key_mask, cache, start, keep_kv)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_finished_rows_leave_within_the_block_and_change_no_answer(eos_prone: Engine, cache: str) -> None:
    """One block of 32: rows that finish early stop being computed before the block ends (with their
    cache rows), and every canvas equals the one decoded without early exit."""
    base = {"gen_length": 32, "block_length": 32, "denoise_steps": 32, "threshold": 0.9, "cache": cache}
    prompts = PROMPTS * 2
    encoded = [eos_prone.encode_prompt(p) for p in prompts]
    with_exit, _ = eos_prone.decode_ids(encoded, eos_prone.params({**base, "early_exit": True}))
    without, _ = eos_prone.decode_ids(encoded, eos_prone.params({**base, "early_exit": False}))
    stop = eos_prone.special.stop_ids
    for a, b in zip(with_exit, without):  # the same answer, up to and including the first stop token
        cut = next((i for i, t in enumerate(b) if t in stop), len(b))
        assert a[: cut + 1] == b[: cut + 1]
    P = max(map(len, encoded))
    prompt = torch.tensor([[eos_prone.tokenizer.pad_id] * (P - len(i)) + i for i in encoded])
    pmask = torch.tensor([[False] * (P - len(i)) + [True] * len(i) for i in encoded])
    net = RowCounter(eos_prone.model)
    params = plan("fast", **{**base, "early_exit": True})
    generate_fast(net, prompt, pmask, params, eos_prone.tokenizer.mask_id, eos_prone.tokenizer.stop_ids, noise(10))
    assert net.rows[0] == 10 and 0 < min(net.rows) < 10  # rows left although there is a single block


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_a_suffix_window_bounds_every_forward_and_a_wide_one_changes_nothing(engine: Engine, cache: str) -> None:
    base = {"gen_length": 32, "block_length": 8, "denoise_steps": 32, "cache": cache, "early_exit": False}
    _, whole, P = run_fast(engine, PROMPTS, plan("fast", **base, suffix_window=0))
    _, wide, _ = run_fast(engine, PROMPTS, plan("fast", **base, suffix_window=32))
    assert [c.tolist() for c in wide.canvases] == [c.tolist() for c in whole.canvases]
    out, net, _ = run_fast(engine, PROMPTS, plan("fast", **base, suffix_window=4))
    # full forwards cover the prompt, the blocks so far, the active block and 4 more, capped at the canvas
    lengths = [c.shape[1] for c in net.canvases]
    assert lengths[0] == P + 8 + 4 and max(lengths) == P + 32 and lengths == sorted(lengths)
    assert not (out == engine.tokenizer.mask_id).any()


def test_order_noise_fades_with_the_share_of_the_block_still_masked(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference's order noise falls to 0 over a block's steps, one commit each; the threshold fills a
    block in a few of its steps, so the fast decoder fades it by the share still masked instead."""
    import celeris_cli.decode.fast as fast_module

    seen: list[torch.Tensor] = []
    real = fast_module.commit_order

    def record(conf, ordering, fade, gens):  # type: ignore[no-untyped-def]
        seen.append(torch.as_tensor(fade).flatten().clone())
        return real(conf, ordering, fade, gens)

    monkeypatch.setattr(fast_module, "commit_order", record)
    mask = engine.tokenizer.mask_id
    sampled = {"temperature": 1.0, "order_temperature": 1.0, "early_exit": False}
    params = plan("fast", gen_length=16, block_length=16, denoise_steps=16, threshold=0.2, cache="none", **sampled)
    out, net, _ = run_fast(engine, PROMPTS, params)
    assert len(seen) == len(net.canvases) >= 2
    for fade, canvas in zip(seen, net.canvases):
        still = (canvas[:, -16:] == mask).sum(1)  # masked before this step, per row
        assert torch.allclose(fade, still / 16)
    # the threshold committed several per step: the share masked fell faster than the steps run
    assert (seen[1] < 1 - 1 / 16).all()
