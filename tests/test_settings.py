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
    GenerationParams,
    check_values,
    honoured,
    model_layer,
)
from celeris_cli.strategy import STRATEGIES

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
        ({"steps": 100_000}, "steps 100000 exceeds"),
        ({"steps": 100_000_000}, "steps must be a positive integer, at most 1048576"),
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
    editing = {"edit_threshold", "max_post_edit_steps"}  # the block strategies' alone
    rnd1 = {"greedy", "eb_gamma"}  # RND1's own sampler's alone
    draft = {"draft_threshold", "drafting"}  # the speculative strategies' alone
    gemma = {"temperature_final", "entropy_bound", "stability_threshold", "confidence_threshold", "stop_token_ids"}
    gemma |= {"noise", "initial_canvases"}  # DiffusionGemma's own decoder's alone
    assert set(KNOBS) - set(honoured("fast")) == dream | block | editing | rnd1 | draft | gemma  # the rest
    shaping = {"presence_penalty", "min_tokens", "subword_min_p"}
    fast_only = {"threshold", "cache", "confidence", "early_exit", "suffix_window"} | shaping
    structure = {
        "structured_outputs",
        "structured_layout",
        "logprobs",
        "top_logprobs",
    }  # the running sets' strategies and block
    assert set(KNOBS) - set(honoured("reference")) == (
        fast_only | dream | block | editing | rnd1 | draft | gemma | structure
    )
    assert set(honoured("diffusion-gemma")) == {"gen_length", "block_length", "denoise_steps", "temperature"} | (
        block | gemma | structure | set(PER_REQUEST)
    )
    assert set(honoured("rnd1")) == {"gen_length", "denoise_steps", "temperature", "top_p", "top_k"} | rnd1 | set(
        PER_REQUEST
    )
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
            "gen_length", "block_length", "denoise_steps", "temperature", "min_p", "top_p", "top_k", "threshold",
            "remasking", "order_temperature", "cfg_scale",
        } | shaping | block | editing | structure | set(PER_REQUEST)  # fmt: skip
    sampling = {"temperature", "min_p", "top_p", "top_k"}
    assert set(honoured("ar")) == {"gen_length"} | sampling | shaping | set(PER_REQUEST)
    assert set(honoured("nemotron")) == {
        "gen_length", "block_length", "denoise_steps", "threshold", "remasking", "order_temperature"
    } | sampling | block | shaping | set(PER_REQUEST)  # fmt: skip
    assert set(honoured("nemotron-spec")) == {"gen_length", "block_length", "draft_threshold"} | sampling | set(
        PER_REQUEST
    )
    assert set(honoured("spec")) == {"gen_length", "denoise_steps", "drafting"} | sampling | shaping | structure | set(
        PER_REQUEST
    )
    for strategy in STRATEGIES:
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


def test_block_diffusion_spreads_a_total_of_steps_over_each_rows_blocks() -> None:
    """denoise_steps on block diffusion: LLaDA's spread (equal shares, the remainder first, at least one per
    block) over the blocks a row decodes, which start at its own position 0, so a prompt ending inside a
    block adds one block; at most one step per masked position of a block, its surplus shared again."""
    params = GenerationParams.from_mapping(
        {"strategy": "block", "gen_length": 64, "block_length": 8, "denoise_steps": 20}
    )
    assert params.steps_for(16) == [3, 3, 3, 3, 2, 2, 2, 2]
    assert params.steps_for(5) == [3, 3, 2, 2, 2, 2, 2, 2, 2]  # 3 masked positions in the first block
    assert params.steps_for(7) == [1, 4, 3, 2, 2, 2, 2, 2, 2]  # one masked position: one step, the rest shared
    assert params.with_(denoise_steps=10).steps_for(7) == [1, 2, 1, 1, 1, 1, 1, 1, 1]
    assert params.with_(denoise_steps=5).steps_for(0) == [1] * 8  # fewer than blocks: one each
    assert params.with_(denoise_steps=64).steps_for(0) == [8] * 8
    blocks = params.part("blocks")
    assert blocks.transfers(3, 8) == [3, 3, 2] and blocks.transfers(3, 3) == [1, 1, 1]  # the masked, in shares
    per_block = params.with_(block_steps=4)  # the per-block spelling: LLaDA2's, the block's length in shares
    assert per_block.steps_for(5) == [4] * 9 and per_block.part("blocks").transfers(4, 3) == [2, 2, 2, 2]
    with pytest.raises(UsageError, match="denoise_steps 65 exceeds gen_length 64"):
        params.with_(denoise_steps=65)


def test_the_last_layer_to_name_the_steps_chooses_their_spelling() -> None:
    model = GenerationParams.defaults_from({"strategy": "block-fast", "block_steps": 2})
    assert not model.steps_total
    asked = GenerationParams.from_mapping({"denoise_steps": 20}, model)  # a user's total over the model's per block
    assert asked.steps_total and asked.report()["denoise_steps"] == 20 and "block_steps" not in asked.report()
    request = GenerationParams.from_mapping({"block_steps": 3}, asked)  # a request over a config's total
    assert not request.steps_total and request.steps_for(0)[0] == 3 and "denoise_steps" not in request.report()
    kept = asked.under({"block_steps": 4, "block_length": 4})  # a script preset does not undo the user's total
    assert kept.steps_total and kept.block_length == 4 and sum(kept.steps_for(0)) == 20
    preset = GenerationParams.from_mapping({}, model).under({"block_steps": 4})
    assert not preset.steps_total and preset.steps_for(0)[0] == 4
    with pytest.raises(UsageError, match="--denoise-steps and --block-steps: give one"):
        GenerationParams.from_mapping({"--denoise-steps": 20, "--block-steps": 2}, model)
    with pytest.raises(UsageError, match="denoise_steps and block_steps: give one"):
        GenerationParams.from_mapping({"denoise_steps": 20, "block_steps": 2}, model)


@pytest.mark.parametrize("strategy", ["fast", "block"])
def test_a_block_longer_than_the_answer_is_refused_by_the_name_given(strategy: str) -> None:
    with pytest.raises(UsageError, match="--block-length 1000 exceeds gen_length 64"):
        GenerationParams.from_mapping({"strategy": strategy, "--block-length": 1000, "gen_length": 64})
    with pytest.raises(UsageError, match="block_length 65 exceeds gen_length 64"):
        GenerationParams.from_mapping({"strategy": strategy, "block_length": 65, "gen_length": 64})
    lower = GenerationParams.from_mapping({"strategy": strategy, "block_length": 32})
    assert GenerationParams.from_mapping({"gen_length": 16}, lower).gen_length == 16  # a later layer's answer length


def test_errors_name_the_setting_as_it_was_written() -> None:
    with pytest.raises(UsageError, match=r"^--top-p must be in \(0, 1\], got 1.5$"):
        GenerationParams.from_mapping({"--top-p": 1.5})
    with pytest.raises(UsageError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        GenerationParams.from_mapping({"top_p": 1.5})
    with pytest.raises(UsageError, match="^--remasking: unknown value 'x'"):
        GenerationParams.from_mapping({"--remasking": "x"})


@pytest.mark.parametrize(("key", "meant"), [("tempreature", "temperature"), ("top-pp", "top_p"), ("step", "steps")])
def test_a_misspelt_setting_names_the_one_meant(key: str, meant: str) -> None:
    for check in (check_values, GenerationParams.from_mapping):  # a config's layer; a request, --set, flags
        with pytest.raises(UsageError, match=f"unknown generation parameter '{key}' \\(did you mean '{meant}'\\?\\)"):
            check({key: 1})


def test_a_setting_like_none_is_not_guessed_at() -> None:
    with pytest.raises(UsageError) as caught:
        check_values({"flavour": 1})
    assert str(caught.value) == "unknown generation parameter 'flavour'"
