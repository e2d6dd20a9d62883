"""Attention over a cache: grouped-query heads through SDPA's own support, and a float32 cache under
bfloat16 that gives the same values as casting a bfloat16 cache at every step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from celeris_cli.arch.kv import KVCache, LayerKV
from celeris_cli.arch.layers import attend
from celeris_cli.arch.llada import LLaDAModel, ModelConfig
from celeris_cli.decode.strategies import Net


def repeated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_grouped_query_attention_equals_repeated_keys_with_and_without_a_cache(
    kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 16, generator=g)
    k, v = torch.randn(2, kv_heads, 4, 16, generator=g), torch.randn(2, kv_heads, 4, 16, generator=g)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding of row 0
    cache = LayerKV(torch.randn(2, kv_heads, 10, 16, generator=g), torch.randn(2, kv_heads, 10, 16, generator=g))
    expected_k, expected_v = cache.k.clone(), cache.v.clone()
    expected_k[:, :, 5:9], expected_v[:, :, 5:9] = k, v
    expected = repeated(q, expected_k, expected_v, mask)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", None)  # attend must not copy keys per head
    y, fresh = attend(q, k, v, mask, cache, 5, upcast=True)
    assert torch.allclose(y, expected, atol=1e-6) and fresh[0] is k
    assert torch.equal(cache.k, expected_k)  # written in place
    y, _ = attend(q, k, v, mask[..., :4], None, 0, upcast=True)
    monkeypatch.undo()
    assert torch.allclose(y, repeated(q, k, v, mask[..., :4]), atol=1e-6)


def test_a_float32_cache_under_bfloat16_gives_the_values_a_cast_at_every_step_gave() -> None:
    cfg = ModelConfig(
        d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=64, vocab_size=50, mask_token_id=4,
        eos_token_id=2,
    )  # fmt: skip
    model = LLaDAModel(cfg)
    model.init_weights(std=0.5, generator=torch.Generator().manual_seed(1))
    model = model.to(torch.bfloat16)
    net = Net(model)
    ids = torch.randint(5, 50, (3, 20), generator=torch.Generator().manual_seed(2))
    km = torch.ones(3, 20, dtype=torch.bool)
    km[1, :4] = False
    pos = Net.positions(km)
    _, kv = net.hidden(ids, pos, km)
    kept = net.cache_of(kv)
    assert all(k.dtype == torch.float32 and k.is_contiguous() for pair in kept.layers for k in pair)
    as_before = KVCache([(k.contiguous(), v.contiguous()) for k, v in kv])  # bfloat16, cast at each step
    window = ids.clone()
    window[:, 10:14] = 4
    a, _ = net.hidden(window[:, 10:14], pos[:, 10:14], km, kept.view(), 10)
    b, _ = net.hidden(window[:, 10:14], pos[:, 10:14], km, as_before.view(), 10)
    assert torch.equal(a, b)
    model.set_upcast(False)  # attention in bfloat16: the cache stays bfloat16
    assert all(k.dtype == torch.bfloat16 for pair in net.cache_of(kv).layers for k in pair)


def test_float_head_weight_is_cast_once_and_follows_the_weight() -> None:
    """The upcast head keeps its float32 weight between forwards, and a changed weight is cast again."""
    import torch

    from celeris_cli.arch.llada import LLaDAModel, ModelConfig

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64, vocab_size=50, mask_token_id=4,
                      eos_token_id=2, weight_tying=True)  # fmt: skip
    model = LLaDAModel(cfg).to(torch.bfloat16).eval()
    h = torch.randn(2, 3, 32).to(torch.bfloat16)
    with torch.no_grad():
        first = model.head(h)
        assert model._head_f32.data_ptr() == model._float_head(model.head_weight()).data_ptr()  # kept
        assert torch.equal(first, torch.nn.functional.linear(h.float(), model.head_weight().float()))
        model.head_weight().mul_(2)  # an in-place change bumps the version: cast again
        assert torch.equal(model.head(h), torch.nn.functional.linear(h.float(), model.head_weight().float()))


def test_float_head_under_inference_mode_casts_per_call() -> None:
    """Weights made under torch.inference_mode have no version counter: the head casts them per call."""
    import torch

    from celeris_cli.arch.llada import LLaDAModel, ModelConfig

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64, vocab_size=50, mask_token_id=4,
                      eos_token_id=2, weight_tying=True)  # fmt: skip
    with torch.inference_mode():
        model = LLaDAModel(cfg).to(torch.bfloat16).eval()
        h = torch.randn(2, 3, 32).to(torch.bfloat16)
        out = model.head(h)
    assert torch.equal(out, torch.nn.functional.linear(h.float(), model.head_weight().float()))
