"""Joint AR + block-diffusion training (`--ar-weight`, Nemotron-Labs-Diffusion's recipe on our layout): the
clean copy is causal and predicts the next token (the AR mode), a noisy block sees the text before it, blocks
start anywhere and half are wholly masked (the draft a self-speculative round appends); the run resumes on its
curve, and the exported model declares its causal context and decodes by self-speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli.arch.checkpoint import read_folder
from celeris_cli.arch.llada import LLaDAModel, ModelConfig
from celeris_cli.errors import UsageError
from celeris_cli.recipe.train import TrainConfig, block_causal_mask, block_mask_batch, joint_loss, train

from .test_training import config, data_dir  # noqa: F401  (the fixture)


def test_the_joint_mask_is_causal_on_the_clean_copy_and_blockwise_on_the_noisy_one() -> None:
    L = 12
    blk = (torch.arange(L)[None, :] + 2) // 4  # blocks of 4 starting at an offset of 2
    m = block_causal_mask(blk, causal=True)[0, 0]
    for q in range(2 * L):
        for k in range(2 * L):
            qb, kb = int(blk[0, q % L]), int(blk[0, k % L])
            if k >= L:
                expected = q >= L and kb == qb
            elif q >= L:
                expected = kb < qb
            else:
                expected = k <= q  # causal: what a causal pass writes into the cache
            assert bool(m[q, k]) == expected, (q, k)


def test_drafting_blocks_start_anywhere_and_half_are_wholly_masked() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(10, 50, (256, 32), generator=g)
    _, mask, p, blk = block_mask_batch(x, 4, g, 0.0, [4], drafting=True)
    assert len({int((blk[r] == 0).sum()) for r in range(256)}) == 4  # the first block: 1 to 4 positions
    whole = [bool(mask[r][blk[r] == b].all()) for r in range(256) for b in range(1, 7)]
    assert 0.4 < sum(whole) / len(whole) < 0.7  # half at ratio 1, and a few more by chance
    _, _, _, plain = block_mask_batch(x, 4, torch.Generator().manual_seed(0), 0.0, [4])
    assert torch.equal(plain, (torch.arange(32) // 4).expand(256, 32))  # without drafting: from position 0


def _model() -> LLaDAModel:
    cfg = ModelConfig(
        d_model=32, n_layers=2, n_heads=4, mlp_hidden_size=64, vocab_size=50, mask_token_id=4, eos_token_id=2
    )
    model = LLaDAModel(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model.eval()


def test_the_ar_loss_at_a_position_does_not_see_the_tokens_after_it() -> None:
    """The AR cross-entropy of the first 8 predictions is unchanged when tokens 9 on change (the next-token
    loss reads a causal clean copy), and changes when token 8 does (it predicts it)."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(10, 50, (1, 16), generator=g)
    noisy, mask, p, blk = block_mask_batch(x, 4, g, 0.0, [4], drafting=True)

    def ar_of(y: torch.Tensor) -> float:
        h, _ = model.hidden(torch.cat([y, noisy], 1), torch.arange(16).repeat(2)[None], block_causal_mask(blk, True))
        return torch.nn.functional.cross_entropy(model.head(h[0, :8]), y[0, 1:9]).item()

    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 7) % 40 + 10
    z = x.clone()
    z[:, 8] = (z[:, 8] + 7) % 40 + 10
    assert ar_of(x) == pytest.approx(ar_of(y), abs=1e-6) and ar_of(x) != pytest.approx(ar_of(z), abs=1e-4)
    with torch.no_grad():
        _, ar = joint_loss(model, x, noisy, mask, p, blk, causal=True)
        _, none = joint_loss(model, x, noisy, mask, p, blk, causal=False)
    assert ar is not None and none is None


def _joint(data: Path, out: Path, tok: Path) -> TrainConfig:
    cfg = config(data, out, tok)
    cfg.block_sizes, cfg.ar_weight = [4], 1.0
    return cfg


def test_joint_training_resumes_on_its_curve_and_exports_a_self_speculative_model(
    data_dir: Path,  # noqa: F811
    tmp_path: Path,
    tiny_tokenizer: Path,
) -> None:
    straight = train(_joint(data_dir, tmp_path / "a", tiny_tokenizer), show_progress=False)
    first = train(_joint(data_dir, tmp_path / "b", tiny_tokenizer), show_progress=False, stop_after=3)
    resumed = train(_joint(data_dir, tmp_path / "b", tiny_tokenizer), show_progress=False)
    assert [r["loss"] for r in first + resumed] == [r["loss"] for r in straight]
    assert all("ar_loss" in r for r in straight) and "heldout_ar_nll" in straight[-1]
    block = _joint(data_dir, tmp_path / "c", tiny_tokenizer)
    block.ar_weight = 0.0
    assert [r["loss"] for r in train(block, show_progress=False)] != [r["loss"] for r in straight]
    raw = json.loads((tmp_path / "a" / "model" / "config.json").read_text())
    assert raw["block_causal"] is True and raw["causal_context"] is True
    arch, _ = read_folder(tmp_path / "a" / "model")
    assert arch.name == "llada_spec" and arch.strategies == ("spec", "ar", "nemotron")
    again = _joint(data_dir, tmp_path / "a", tiny_tokenizer)
    again.ar_weight = 0.0
    with pytest.raises(UsageError, match="trained with the AR mode"):
        train(again, show_progress=False)


def test_the_ar_weight_needs_blocks(data_dir: Path, tmp_path: Path, tiny_tokenizer: Path) -> None:  # noqa: F811
    cfg = config(data_dir, tmp_path / "x", tiny_tokenizer)
    cfg.ar_weight = 1.0
    with pytest.raises(UsageError, match="give --block-size too"):
        train(cfg, show_progress=False)
