from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli.arch.checkpoint import load_model, save_model
from celeris_cli.arch.llada import LLaDAModel, ModelConfig
from celeris_cli.arch.tokenizer import load_tokenizer
from celeris_cli.errors import ModelError

from .conftest import make_model


def _state(model: LLaDAModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_save_load_round_trip_keeps_weights_and_outputs(tmp_path: Path, tiny_tokenizer: Path) -> None:
    folder = make_model(tmp_path / "m", tiny_tokenizer, seed=3)
    loaded = load_model(folder)
    again = tmp_path / "again"
    save_model(loaded, again)
    reloaded = load_model(again)
    a, b = _state(loaded), _state(reloaded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(loaded(ids), reloaded(ids))


def test_llada_tensor_names_are_used(tiny_model: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.transformer.wte.weight" in names
    assert "model.transformer.blocks.1.ff_proj.weight" in names
    assert "model.transformer.blocks.0.attn_out.weight" in names
    assert "model.transformer.ff_out.weight" in names  # untied LM head, as LLaDA
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["n_kv_heads"] == cfg["n_heads"]


def test_sharded_checkpoint_loads_the_same_model(tmp_path: Path, tiny_tokenizer: Path) -> None:
    single = make_model(tmp_path / "single", tiny_tokenizer, seed=1)
    sharded = make_model(tmp_path / "sharded", tiny_tokenizer, seed=1, max_shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    a, b = _state(load_model(single)), _state(load_model(sharded))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_is_a_clear_error(tmp_path: Path, tiny_tokenizer: Path) -> None:
    sharded = make_model(tmp_path / "sharded", tiny_tokenizer, max_shard_bytes=20_000)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelError, match="missing shard"):
        load_model(sharded)


def test_weights_that_do_not_match_config_are_rejected(tmp_path: Path, tiny_tokenizer: Path) -> None:
    folder = make_model(tmp_path / "m", tiny_tokenizer)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["d_model"] = 64
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="shape"):
        load_model(folder)


def test_pickle_weights_are_never_loaded(tmp_path: Path, tiny_tokenizer: Path) -> None:
    folder = make_model(tmp_path / "m", tiny_tokenizer)
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pickle"):
        load_model(folder)


def test_grouped_query_attention_config_runs() -> None:
    cfg = ModelConfig(
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        mlp_hidden_size=64,
        vocab_size=50,
        mask_token_id=4,
        eos_token_id=2,
    )
    model = LLaDAModel(cfg)
    model.init_weights()
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 50)


def test_unsupported_architecture_key_is_named() -> None:
    raw = dict(
        d_model=32,
        n_layers=1,
        n_heads=4,
        mlp_hidden_size=64,
        vocab_size=50,
        mask_token_id=4,
        eos_token_id=2,
        alibi=True,
    )
    with pytest.raises(ModelError, match="alibi"):
        ModelConfig.from_dict(raw)


def test_tokenizer_of_another_model_is_rejected(tmp_path: Path, tiny_tokenizer: Path) -> None:
    folder = make_model(tmp_path / "m", tiny_tokenizer, mask_token_id=7)
    with pytest.raises(ModelError, match="does not match the config"):
        load_tokenizer(folder, load_model(folder).cfg)


def test_traditional_prompt_is_folded_to_simplified(tiny_model: Path) -> None:
    tok = load_tokenizer(tiny_model, load_model(tiny_model).cfg)
    assert tok.encode("舉頭")[1:] == tok.encode("举頭")[1:]
