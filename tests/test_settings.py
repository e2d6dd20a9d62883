"""The settings model: every knob validated once, by name; a knob a strategy does not honour is an error;
layers merge in the documented order; a transformers generation_config.json is read for what it means."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from celeris_cli import load_engine
from celeris_cli.errors import ModelError, UsageError
from celeris_cli.params import (
    KNOBS,
    MAX_SEED,
    PER_REQUEST,
    STRATEGY_PARTS,
    GenerationParams,
    check_values,
    honoured,
    model_layer,
)

from .conftest import make_model


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"cfg_scale": math.inf}, "cfg_scale"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"stop": ""}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"gen_length": 8, "denoise_steps": 9}, "denoise_steps"),
        ({"steps": 100_000_000}, "denoise_steps"),
        ({"n_layers": 2}, "n_layers"),
        ({"early_exit": "yes"}, "early_exit"),
    ],
)
def test_bad_values_are_user_errors_that_name_the_setting(values: dict, named: str) -> None:
    with pytest.raises(UsageError, match=named):
        GenerationParams.from_mapping(values)


def test_the_largest_seed_is_accepted() -> None:
    assert GenerationParams.from_mapping({"seed": MAX_SEED}).seed == MAX_SEED


@pytest.mark.parametrize("knob", ["threshold", "cache", "confidence", "early_exit"])
def test_a_knob_the_strategy_does_not_honour_is_an_error_naming_both(knob: str) -> None:
    value = {"threshold": 0.5, "cache": "none", "confidence": "margin", "early_exit": False}[knob]
    with pytest.raises(UsageError, match=rf"{knob}: not used by the reference strategy"):
        GenerationParams.from_mapping({"strategy": "reference", knob: value})
    model_defaults = GenerationParams.from_mapping({knob: value}).as_defaults()  # a model folder's layer ...
    assert model_defaults.with_(strategy="reference").strategy == "reference"  # ... does not block a switch
    assert knob not in model_defaults.with_(strategy="reference").report()  # and the report says what ran
    queue_layer = GenerationParams.from_mapping({knob: value})  # batch.yaml's layer is the user's own ...
    with pytest.raises(UsageError, match=rf"{knob}: not used by the reference strategy"):
        queue_layer.with_(strategy="reference")  # ... so a request switching strategy under it is told so


def test_building_the_record_directly_is_validated_too() -> None:
    with pytest.raises(UsageError, match="remasking"):
        GenerationParams(remasking="bogus")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="temperature"):
        GenerationParams(temperature=math.inf)
    assert GenerationParams(stop=["a"]).stop == ("a",)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="temperature must be a finite number"):
        GenerationParams.from_mapping({"temperature": 10**400})


def test_every_strategy_declares_what_it_honours() -> None:
    dream, block = {"eps", "alg", "alg_temp"}, {"block_steps"}
    assert set(KNOBS) - set(honoured("fast")) == dream | block  # the fast decoder honours the rest
    shaping = {"presence_penalty", "min_tokens", "subword_min_p"}
    fast_only = {"threshold", "cache", "confidence", "early_exit", "suffix_window"} | shaping
    assert set(KNOBS) - set(honoured("reference")) == fast_only | dream | block
    assert set(honoured("dream")) == {
        "gen_length",
        "denoise_steps",
        "temperature",
        "min_p",
        "top_p",
        "top_k",
    } | dream | set(PER_REQUEST)
    for strategy in ("block", "block-fast"):
        assert set(honoured(strategy)) == {
            "gen_length", "block_length", "temperature", "min_p", "top_p", "top_k", "threshold",
        } | shaping | block | set(PER_REQUEST)  # fmt: skip
    for strategy in STRATEGY_PARTS:
        assert set(PER_REQUEST) <= set(honoured(strategy))


def test_steps_from_a_lower_layer_are_settled_to_the_canvas_and_explicit_ones_are_checked() -> None:
    model_defaults = GenerationParams.from_mapping({"gen_length": 64, "denoise_steps": 64}).as_defaults()
    assert model_defaults.with_(gen_length=16).denoise_steps == 16  # the user asked only for a shorter canvas
    queue = model_defaults.with_(denoise_steps=20)  # batch.yaml's steps, then a request that shortens the canvas
    assert queue.with_(gen_length=16).denoise_steps == 16
    with pytest.raises(UsageError, match="denoise_steps 20 exceeds gen_length 16"):
        model_defaults.with_(gen_length=16, denoise_steps=20)


def test_random_remasking_replaces_order_noise_and_rejects_it_when_asked_for() -> None:
    base = GenerationParams.from_mapping({"order_temperature": 1.0}).as_defaults()  # the model's default
    assert base.with_(remasking="random").order_temperature == 0.0
    with pytest.raises(UsageError, match="order_temperature"):
        base.with_(remasking="random", order_temperature=0.5)


def test_steps_per_block_never_exceed_a_blocks_tokens() -> None:
    p = GenerationParams.from_mapping({"gen_length": 10, "block_length": 8, "denoise_steps": 10})
    assert p.schedule.block_spans == [(0, 8), (8, 10)]
    assert p.schedule.steps_per_block == [5, 2]  # 5 + 5 asked; the 2-token block cannot use more than 2
    assert (
        GenerationParams.from_mapping(
            {"gen_length": 64, "block_length": 4, "denoise_steps": 3}
        ).schedule.steps_per_block
        == [1] * 16
    )


def test_requests_differing_only_in_seed_share_a_batch_key() -> None:
    a, b = GenerationParams.from_mapping({"seed": 1}), GenerationParams.from_mapping({"seed": 2})
    assert a != b and a.batch_key() == b.batch_key()
    assert a.batch_key() != GenerationParams.from_mapping({"seed": 1, "temperature": 0.5}).batch_key()


def test_hf_generation_config_keys_are_mapped_and_bookkeeping_ignored() -> None:
    raw = {
        "_from_model_config": True,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "bos_token_id": 1,
        "pad_token_id": 2,
        "eos_token_id": [2, 7],
        "max_new_tokens": 48,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "threshold": 0.8,
    }
    settings, stops, ignored = model_layer(raw)
    assert settings == {"gen_length": 48, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "threshold": 0.8}
    assert stops == {2, 7}
    assert set(ignored) == {"_from_model_config", "transformers_version", "use_cache", "bos_token_id", "pad_token_id"}
    assert model_layer({"do_sample": False, "temperature": 0.7})[0]["temperature"] == 0.0
    assert model_layer({"top_k": None, "temperature": None, "eos_token_id": None}) == ({}, frozenset(), [])


def test_a_transformers_saved_folder_loads_and_its_settings_apply(tmp_path: Path, tiny_model: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    gc = {"_from_model_config": True, "eos_token_id": [2, 9], "max_new_tokens": 12, "temperature": 0.5, "x": 1}
    (folder / "generation_config.json").write_text(json.dumps(gc))
    e = load_engine(folder, device="cpu", dtype="float32")
    assert 9 in e.special.stop_ids and 2 in e.special.stop_ids
    assert (e.params().gen_length, e.params().temperature) == (12, 0.5)
    [r] = e.generate(["床前"], e.params({"denoise_steps": 4}))
    assert r.settings["gen_length"] == 12
    with pytest.raises(UsageError, match="unknown generation parameter 'x'"):
        e.params({"x": 1})  # unknown keys are ignored in a model folder, never in user input


def test_python_api_without_params_uses_the_model_defaults(tmp_path: Path, tiny_model: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text('{"gen_length": 6, "block_length": 6, "denoise_steps": 3}')
    e = load_engine(folder, device="cpu", dtype="float32")
    [r] = e.generate(["床前"])
    assert r.settings["gen_length"] == 6 and r.steps_per_block == [3]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("n_layers", 6.0, "n_layers must be an integer"),
        ("n_layers", "6", "n_layers must be an integer"),
        ("max_sequence_length", "512", "max_sequence_length must be an integer"),
        ("rope_theta", "1e4", "rope_theta must be a number"),
        ("weight_tying", 1, "weight_tying must be true or false"),
        ("n_layers", 0, "n_layers must be positive"),
    ],
)
def test_config_json_fields_are_type_checked_by_name(
    tmp_path: Path, tiny_tokenizer: Path, key: str, value: object, message: str
) -> None:
    folder = make_model(tmp_path / "m", tiny_tokenizer)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=message):
        load_engine(folder, device="cpu", dtype="float32")


@pytest.mark.parametrize(("key", "meant"), [("tempreature", "temperature"), ("top-pp", "top_p"), ("step", "steps")])
def test_a_misspelt_setting_names_the_one_meant(key: str, meant: str) -> None:
    for check in (check_values, GenerationParams.from_mapping):  # a config's layer; a request, --set, flags
        with pytest.raises(UsageError, match=f"unknown generation parameter '{key}' \\(did you mean '{meant}'\\?\\)"):
            check({key: 1})


def test_a_setting_like_none_is_not_guessed_at() -> None:
    with pytest.raises(UsageError) as caught:
        check_values({"flavour": 1})
    assert str(caught.value) == "unknown generation parameter 'flavour'"
