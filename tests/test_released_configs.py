"""The files people download: every released config in tests/data/released (copies of published config,
generation-config, tokenizer-config and chat-template files; SOURCES.md says where each came from) read
through the loader `celeris generate` uses, its network built on the meta device, and its facts checked
against the file itself. The expectations are read from the JSON here, by key names, with no loader code: a
released file that stops loading, or loads as another shape, fails."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli.arch.folder import ModelFolder
from celeris_cli.arch.tokenizer import chat_template_of
from celeris_cli.cli import app
from celeris_cli.errors import ModelError

DATA = Path(__file__).parent / "data"
RELEASED = DATA / "released"
WHOLE = sorted(p for p in RELEASED.iterdir() if (p / "config.json").is_file())
GEMMA = RELEASED / "google__diffusiongemma-26B-A4B-it"


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _first(raw: dict[str, Any], *keys: str) -> Any:
    return next((raw[k] for k in keys if raw.get(k) is not None), None)


def _eos_expected(folder: Path) -> list[int] | str:
    """transformers' order: config.json, then generation_config.json, then the tokenizer's eos_token."""
    for name in ("config.json", "generation_config.json"):
        eos = _json(folder / name).get("eos_token_id")
        if eos is not None:
            return eos if isinstance(eos, list) else [eos]
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        eos = _json(folder / name).get("eos_token")
        if eos is not None:
            return eos["content"] if isinstance(eos, dict) else eos
    raise AssertionError(f"{folder}: no eos anywhere")


def _meta_state(folder: ModelFolder) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = folder.arch.build(folder.cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("path", WHOLE, ids=[p.name for p in WHOLE])
def test_a_released_folder_loads_and_builds_the_shape_its_file_gives(path: Path) -> None:
    raw = _json(path / "config.json")
    folder = ModelFolder.open(path)
    state = _meta_state(folder)
    layers = {int(i) for name in state for i in re.findall(r"\.(?:layers|blocks)\.(\d+)\.", name)}
    assert len(layers) == _first(raw, "num_hidden_layers", "n_layers")
    embedding = next(shape for name, shape in state.items() if re.search(r"(embed_tokens|wte|word_embeddings)\.", name))
    assert embedding[0] == _first(raw, "embedding_size", "vocab_size")
    assert embedding[1] == _first(raw, "hidden_size", "d_model")
    heads, kv = _first(raw, "num_attention_heads", "n_heads"), _first(raw, "num_key_value_heads", "n_kv_heads")
    head_dim = raw.get("head_dim") or embedding[1] // heads
    q = next(shape for name, shape in state.items() if re.search(r"\.(q_proj|query_key_value)\.weight$", name))
    fused = any("query_key_value" in name for name in state)
    assert q[0] == (heads + 2 * (kv or heads)) * head_dim if fused else heads * head_dim
    experts = {int(e) for name in state for e in re.findall(r"experts\.(\d+)\.", name)}
    assert len(experts) == (raw.get("num_experts") or 0)
    eos = _eos_expected(path)
    if isinstance(eos, list):
        assert folder.cfg.eos_token_id == eos[0]
        assert set(eos) <= folder.extra_stops | {folder.cfg.eos_token_id}
    else:  # only the tokenizer names it: left to the tokenizer, and said so
        assert folder.cfg.eos_token_id is None
        assert repr(eos) in folder.eos_named()
    tokenizer_config = _json(path / "tokenizer_config.json")
    jinja = path / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else tokenizer_config.get("chat_template")
    assert chat_template_of(path) == template
    if tokenizer_config:
        assert template, f"{path.name}: every released chat model here ships a template"


@pytest.mark.parametrize("path", WHOLE, ids=[p.name for p in WHOLE])
def test_inspect_memory_exits_0_and_names_what_it_ignored(path: Path) -> None:
    result = CliRunner().invoke(app, ["inspect", str(path), "--memory", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    ignored = result.output.split("config.json keys ignored: ")[1].strip().split(", ")
    raw = _json(path / "config.json")
    assert "transformers_version" in ignored and all(k in raw for k in ignored)
    assert "num_hidden_layers" not in ignored and "vocab_size" not in ignored


def test_training_keys_are_ignored_and_listed() -> None:
    result = CliRunner().invoke(app, ["inspect", str(RELEASED / "JetLM__SDAR-4B-Chat"), "--memory", "--json"])
    assert result.exit_code == 0, result.output
    assert {"use_deepep", "debug", "ep_size"} <= set(json.loads(result.output)["ignored"])


def _folder_with(tmp_path: Path, config: dict[str, Any], **files: dict[str, Any]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, raw in files.items():
        (folder / f"{name}.json").write_text(json.dumps(raw), encoding="utf-8")
    return folder


def test_the_shipped_diffusiongemma_config_loads_with_its_eos_list(tmp_path: Path) -> None:
    """The 26B-A4B's config.json as shipped (trimmed to the keys its copy kept): a top-level `eos_token_id`
    list, multimodal keys, `use_bidirectional_attention: "vision"`."""
    raw = _json(GEMMA / "config.json.partial2")
    assert raw["eos_token_id"] == [1, 106]
    folder = ModelFolder.open(_folder_with(tmp_path, raw))
    assert folder.cfg.eos_token_id == 1 and {1, 106} <= folder.extra_stops
    state = _meta_state(folder)
    assert state["model.decoder.embed_tokens.weight"] == (262144, 2816)
    assert {"vision_config", "image_token_id", "vision_soft_tokens_per_image"} <= set(folder.ignored_keys)
    assert len({int(i) for name in state for i in re.findall(r"\.layers\.(\d+)\.", name)}) == 30


def test_a_pre_quantized_conversion_is_refused_by_name(tmp_path: Path) -> None:
    raw = _json(GEMMA / "config.json.partial")  # an MLX 4-bit conversion's config
    with pytest.raises(ModelError, match="quantization is not supported"):
        ModelFolder.open(_folder_with(tmp_path, raw))


def test_llada_moe_is_told_by_its_experts_whatever_class_it_names(tmp_path: Path) -> None:
    raw = _json(DATA / "llada_moe" / "lladamoe_tiny" / "config.json")
    assert raw["model_type"] == "llada"  # as LLaDA-MoE's own config class saves it
    for variant in ({}, {"architectures": ["LLaDAModelLM"]}):
        config = {k: v for k, v in raw.items() if k != "architectures"} | variant
        folder = tmp_path / str(len(variant))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        assert ModelFolder.open(folder).arch.name == "llada_moe"


def _copy(src: Path, dst: Path, drop: tuple[str, ...]) -> Path:
    shutil.copytree(src, dst)
    raw = _json(dst / "config.json")
    (dst / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in drop}))
    return dst


def test_llada2_without_a_config_eos_takes_the_generation_config_then_the_tokenizers(tmp_path: Path) -> None:
    """LLaDA2.0-mini's and 2.1-mini's released config.json name no eos: it comes from generation_config.json,
    else from the tokenizer's eos_token (tokenizer_config.json, then special_tokens_map.json), and the answer is
    the one the folder with the key gives."""
    from celeris_cli.engine import load_engine

    tiny = DATA / "llada2" / "llada2_tiny"
    eos = _json(tiny / "config.json")["eos_token_id"]
    generation = _copy(tiny, tmp_path / "generation", ("eos_token_id",))
    (generation / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 3]}))
    folder = ModelFolder.open(generation)
    assert folder.cfg.eos_token_id == eos and 3 in folder.extra_stops
    bare = _copy(tiny, tmp_path / "bare", ("eos_token_id", "pad_token_id"))
    (bare / "generation_config.json").unlink()
    assert ModelFolder.open(bare).cfg.eos_token_id is None
    assert ModelFolder.open(bare).tokenizer().eos_id == eos
    tokenizer_config = _json(bare / "tokenizer_config.json")
    assert tokenizer_config.pop("eos_token") == "<|endoftext|>"
    (bare / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert ModelFolder.open(bare).tokenizer().eos_id == eos  # special_tokens_map.json's
    settings = {"gen_length": 16, "temperature": 0.0}
    answers = []
    for path in (tiny, bare):
        engine = load_engine(path, device="cpu", dtype="float32")
        answers.append([(r.text, r.finish_reason) for r in engine.generate(["a b c", "the"], engine.params(settings))])
    assert answers[0] == answers[1]


def test_sdar_as_released_takes_its_mask_from_the_tokenizer(tmp_path: Path) -> None:
    """The released SDAR configs name no `mask_token_id` and no `block_size` (our fixture has both): the mask
    is the tokenizer's `<|MASK|>` and the block its generate.py's default."""
    tiny = next((DATA / "sdar").glob("*/config.json")).parent
    mask = _json(tiny / "config.json")["mask_token_id"]
    released = _copy(tiny, tmp_path / "sdar", ("mask_token_id", "block_size"))
    folder = ModelFolder.open(released)
    assert folder.tokenizer().mask_id == mask
    assert folder.defaults().block_length == 4
