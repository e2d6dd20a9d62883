"""Block diffusion for our own layout: the training mask lets no token see a later block (nor a noisy token
another block's noise), the run resumes exactly, and the exported model is block-causal, runs the block
decoders only, and its cached decoder equals its reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli.arch.checkpoint import load_model, read_folder
from celeris_cli.arch.llada import LLaDAModel, ModelConfig
from celeris_cli.decode.block import block_mask
from celeris_cli.errors import UsageError
from celeris_cli.recipe.train import TrainConfig, block_causal_mask, block_mask_batch, diffusion_loss, train

from .test_training import config, data_dir  # noqa: F401  (the fixture)


@pytest.mark.parametrize("width", [1, 3, 4, 8])
def test_training_mask_lets_no_token_see_a_later_block(width: int) -> None:
    L = 16
    m = block_causal_mask(torch.arange(L)[None, :] // width)[0, 0]  # (2L, 2L)
    for q in range(2 * L):
        q_noisy, q_blk = q >= L, (q % L) // width
        for k in range(2 * L):
            k_noisy, k_blk = k >= L, (k % L) // width
            if k_noisy:  # noise is seen only by the noisy copy of its own block
                expected = q_noisy and k_blk == q_blk
            elif q_noisy:  # a noisy block's context: the clean blocks strictly before it
                expected = k_blk < q_blk
            else:  # the clean copy: block-causal, as the decoder's cache of committed blocks holds it
                expected = k_blk <= q_blk
            assert bool(m[q, k]) == expected, (q, k)


def test_decoder_mask_lets_no_token_see_a_later_block() -> None:
    W, C = 4, 12
    real = torch.ones(1, C, dtype=torch.bool)
    m = block_mask(real, 0, C, C, W)[0, 0]
    q = torch.arange(C)[:, None] // W
    k = torch.arange(C)[None, :] // W
    assert torch.equal(m, k <= q)


def _model(block_causal: bool) -> LLaDAModel:
    cfg = ModelConfig(
        d_model=32,
        n_layers=2,
        n_heads=4,
        mlp_hidden_size=64,
        vocab_size=50,
        mask_token_id=4,
        eos_token_id=2,
        block_causal=block_causal,
    )
    model = LLaDAModel(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model.eval()


def test_block_loss_does_not_depend_on_later_blocks() -> None:
    """The loss on block b, computed in the doubled sequence, is unchanged when every later token changes:
    the property the exact cache relies on, through the real network."""
    model = _model(True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(10, 50, (1, 16), generator=g)
    noisy, mask, p, width = block_mask_batch(x, 4, g, 0.0, [4])
    first = mask.clone()
    first[:, 8:] = False  # the loss of blocks 0 and 1 only
    y = x.clone()
    y[:, 8:] = torch.randint(10, 50, (1, 8), generator=g)
    noisy_y = torch.where(mask, 4, y)
    with torch.no_grad():
        a = diffusion_loss(model, x, noisy, first, p, width)
        b = diffusion_loss(model, y, noisy_y, first, p, width)
        whole = diffusion_loss(model, y, noisy_y, mask, p, width)
    assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(a, whole)


def test_each_block_draws_its_own_mask_ratio() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(10, 50, (64, 32), generator=g)
    _, _, p, blk = block_mask_batch(x, 4, g, 0.0, [4, 8])
    width = (blk == 0).sum(1)  # blocks from position 0: the first one's length is the row's block length
    assert set(width.tolist()) == {4, 8}
    for row, b, w in zip(p, blk, width.tolist()):
        assert torch.equal(b, torch.arange(32) // w)
        blocks = row.view(-1, w)
        assert torch.all(blocks == blocks[:, :1])  # one ratio per block
        assert len(set(blocks[:, 0].tolist())) > 1  # and not one per row


def _block_config(data: Path, out: Path, tok: Path) -> TrainConfig:
    cfg = config(data, out, tok)
    cfg.block_sizes = [4, 8]
    return cfg


def test_block_training_resumes_on_the_same_loss_curve(
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    tiny_tokenizer: Path,
) -> None:
    straight = train(_block_config(data_dir, tmp_path / "a", tiny_tokenizer), show_progress=False)
    first = train(_block_config(data_dir, tmp_path / "b", tiny_tokenizer), show_progress=False, stop_after=3)
    resumed = train(_block_config(data_dir, tmp_path / "b", tiny_tokenizer), show_progress=False)
    assert [r["loss"] for r in first + resumed] == [r["loss"] for r in straight]
    assert resumed[-1]["heldout_nll"] == straight[-1]["heldout_nll"]
    plain = train(config(data_dir, tmp_path / "c", tiny_tokenizer), show_progress=False)
    assert [r["loss"] for r in plain] != [r["loss"] for r in straight]  # the block sizes change the objective


def test_training_from_init_starts_from_its_weights(
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    tiny_tokenizer: Path,
) -> None:
    base = config(data_dir, tmp_path / "base", tiny_tokenizer)
    base.steps = 3
    train(base, show_progress=False)
    src = load_model(tmp_path / "base" / "model")
    settings = '{"gen_length": 16, "temperature": 0.7}'
    (tmp_path / "base" / "model" / "generation_config.json").write_text(settings)
    cfg = _block_config(data_dir, tmp_path / "block", tiny_tokenizer)
    cfg.init, cfg.steps, cfg.lr = str(tmp_path / "base" / "model"), 1, 0.0
    train(cfg, show_progress=False)
    out = load_model(tmp_path / "block" / "model")
    for (name, a), (_, b) in zip(src.state_dict().items(), out.state_dict().items()):
        assert torch.equal(a, b), name  # lr 0: the weights are the init's
    # a bidirectional parent's settings (its strategy) would not run on the block model: not copied
    assert not (tmp_path / "block" / "model" / "generation_config.json").exists()
    child = _block_config(data_dir, tmp_path / "child", tiny_tokenizer)
    child.init, child.steps, child.lr = str(tmp_path / "block" / "model"), 1, 0.0
    settings = '{"strategy": "block", "gen_length": 16, "temperature": 0.7}'
    (tmp_path / "block" / "model" / "generation_config.json").write_text(settings)
    train(child, show_progress=False)
    assert (tmp_path / "child" / "model" / "generation_config.json").read_text() == settings  # a block parent's are
    from celeris_cli import load_engine

    assert load_engine(tmp_path / "child" / "model", device="cpu").params({}).strategy == "block"
    wrong = _block_config(data_dir, tmp_path / "wrong", tiny_tokenizer)
    wrong.init, wrong.d_model = str(tmp_path / "base" / "model"), 64
    with pytest.raises(UsageError, match="do not fit"):
        train(wrong, show_progress=False)


@pytest.fixture()
def block_model(data_dir: Path, tmp_path: Path, tiny_tokenizer: Path) -> Path:  # noqa: F811
    train(_block_config(data_dir, tmp_path / "run", tiny_tokenizer), show_progress=False)
    return tmp_path / "run" / "model"


def test_exported_block_model_runs_the_block_decoders_only(block_model: Path) -> None:
    from celeris_cli import load_engine

    assert json.loads((block_model / "config.json").read_text())["block_causal"] is True
    arch, cfg = read_folder(block_model)
    assert arch.name == "llada_block" and arch.default_strategy == "block-fast"
    engine = load_engine(block_model, device="cpu", dtype="float32")
    assert engine.model.block_causal
    prompts = ["床前明月光，", "The jury said it", "白日"]
    settings = {"gen_length": 24, "block_length": 4, "block_steps": 4, "temperature": 0.0, "seed": 3}
    before = engine.positions_computed
    fast = engine.generate(prompts, engine.params({**settings, "strategy": "block-fast"}), batch_size=3)
    cached = engine.positions_computed - before
    ref = engine.generate(prompts, engine.params({**settings, "strategy": "block"}), batch_size=3)
    assert [r.text for r in fast] == [r.text for r in ref]
    assert cached < engine.positions_computed - before - cached  # the cache was used
    with pytest.raises(UsageError, match="does not run on the llada_block architecture"):
        engine.params({"strategy": "fast"})


def test_bidirectional_config_stays_llada_s_own(tmp_path: Path) -> None:
    from celeris_cli.arch.checkpoint import save_model

    save_model(_model(False), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "block_causal" not in raw
    assert read_folder(tmp_path / "m")[0].name == "llada"


def test_eval_nll_of_a_block_model_is_its_block_bound(block_model: Path) -> None:
    from celeris_cli import load_engine
    from celeris_cli.measure.evaluate import heldout_nll
    from celeris_cli.recipe.train import nll_bound

    from .conftest import LINES

    engine = load_engine(block_model, device="cpu", dtype="float32")
    got = heldout_nll(engine, LINES, seq_len=16, draws=2)
    flat: list[int] = []
    for d in LINES:
        flat += engine.tokenizer.encode(d) + [engine.tokenizer.eos_id]
    x = torch.tensor(flat[: len(flat) // 16 * 16]).view(-1, 16)
    mask_id = engine.tokenizer.mask_id

    def bound(sizes: list[int] | None) -> float:
        return nll_bound(engine.model, x, mask_id, torch.Generator().manual_seed(0), 2, rows=32, sizes=sizes)[0]

    assert got == bound([engine.params({}).block_length]) and got != bound(None)


def test_the_shipped_block_model_loads_by_name_and_decodes_with_its_defaults() -> None:
    from celeris_cli import load_engine

    engine = load_engine("celeris-block", device="cpu", dtype="float32")
    assert engine.arch.name == "llada_block" and engine.model.block_causal
    params = engine.params({"gen_length": 16})
    assert (params.strategy, params.block_length, params.block_steps) == ("block-fast", 8, 2)
    [a, b] = engine.generate(["床前明月光，", "床前明月光，"], params, batch_size=2, seeds=[0, 1])
    assert a.output_tokens > 0 and a.text != b.text  # sampled: the seed matters
    [en] = engine.generate(["The jury said it"], params)  # English runs the model's Latin-script preset
    assert (en.settings["block_length"], en.settings["block_steps"], en.settings["presence_penalty"]) == (4, 4, 1.2)
    assert en.settings["subword_min_p"] == 0.8
    assert en.settings["min_tokens"] == 4 and en.output_tokens >= 4
    with pytest.raises(UsageError, match="does not run on the llada_block architecture"):
        engine.params({"strategy": "reference"})


def test_a_block_causal_config_named_by_class_is_the_block_variant() -> None:
    from celeris_cli.arch.registry import architecture_of

    assert architecture_of({"architectures": ["LLaDAModelLM"], "block_causal": True}).name == "llada_block"
    assert architecture_of({"architectures": ["LLaDAModelLM"]}).name == "llada"


def test_resuming_with_other_block_sizes_is_refused(
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    tiny_tokenizer: Path,
) -> None:
    train(_block_config(data_dir, tmp_path / "run", tiny_tokenizer), show_progress=False, stop_after=2)
    plain = config(data_dir, tmp_path / "run", tiny_tokenizer)
    with pytest.raises(UsageError, match=r"trained with block sizes \[4, 8\]"):
        train(plain, show_progress=False)
    other = _block_config(data_dir, tmp_path / "run", tiny_tokenizer)
    other.block_sizes = [4]
    with pytest.raises(UsageError, match="resume it with the same --block-size"):
        train(other, show_progress=False)


def test_init_from_a_model_with_another_tokenizer_than_the_run_s_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    from celeris_cli.recipe.train import run_recipe

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("x\n", encoding="utf-8")
    (tmp_path / "run" / "data").mkdir(parents=True)
    (tmp_path / "run" / "data" / "tokenizer.model").write_bytes(b"another tokenizer")
    with pytest.raises(UsageError, match="holds another tokenizer"):
        run_recipe(corpus, tmp_path / "run", init=str(tiny_model), block_sizes=[4])


def test_block_fast_never_reads_a_cache_slot_it_has_not_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is allocated uninitialised: fill every slot not yet written with NaN (SDPA passes NaN on even
    from masked keys) and the cached decoder must still give the reference decoder's answers, across block
    lengths, a first block with no whole prompt block, and rows leaving at a block's start and mid-block."""
    from celeris_cli import load_engine
    from celeris_cli.arch.kv import KVCache

    real_of, real_keep = KVCache.of, KVCache.keep

    def poison(cache: KVCache, written: int) -> None:
        for ck, cv in cache.layers:
            ck[:, :, written:], cv[:, :, written:] = float("nan"), float("nan")

    def of(cls, kv, length):  # type: ignore[no-untyped-def]
        cache = real_of(kv, length)
        poison(cache, kv[0][0].shape[2])
        return cache

    def keep(self, rows, written=None):  # type: ignore[no-untyped-def]
        real_keep(self, rows, written)
        if written is not None:
            poison(self, written)

    monkeypatch.setattr(KVCache, "of", classmethod(of))
    monkeypatch.setattr(KVCache, "keep", keep)
    engine = load_engine("celeris-block", device="cpu", dtype="float32")
    prompts = ["白", "The jury said it was a fine day and", "床前明月光，疑是地上霜。", "春眠不觉晓，"]
    for width, steps, temperature in ((2, 1, 0.0), (4, 4, 1.0), (8, 2, 1.0)):
        s = {"gen_length": 24, "block_length": width, "block_steps": steps, "temperature": temperature}
        seeds = list(range(len(prompts)))
        fast = engine.generate(prompts, engine.params({**s, "strategy": "block-fast"}), batch_size=4, seeds=seeds)
        ref = engine.generate(prompts, engine.params({**s, "strategy": "block"}), batch_size=4, seeds=seeds)
        assert [r.text for r in fast] == [r.text for r in ref], s
