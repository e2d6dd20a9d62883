from __future__ import annotations

from pathlib import Path

import pytest
import torch

from celeris_cli import GenerationParams, load_engine
from celeris_cli.engine import Engine
from celeris_cli.errors import UsageError

from .conftest import LogitsFake

PROMPTS = [
    "床前明月光，",
    "To be, or not to be: that is the question. Shall I compare thee",
    "白日依山尽，黄河入海流。欲穷千里目，",
    "The quick",
    "春",
]


def test_prompt_decodes_identically_alone_and_in_a_mixed_batch(engine: Engine) -> None:
    params = engine.params(
        {
            "gen_length": 24,
            "block_length": 8,
            "denoise_steps": 12,
            "temperature": 0.0,
            "remasking": "low_confidence",
            "seed": 5,
        }
    )
    lengths = {len(engine.encode_prompt(p)) for p in PROMPTS}
    assert len(lengths) == len(PROMPTS)  # really different lengths, so padding is exercised
    batched = engine.generate(PROMPTS, params, batch_size=len(PROMPTS))
    assert {r.batch_size for r in batched} == {len(PROMPTS)}
    for prompt, together in zip(PROMPTS, batched):
        [alone] = engine.generate([prompt], params, batch_size=1)
        assert together.text == alone.text
        assert together.output_tokens == alone.output_tokens


@pytest.mark.parametrize("early_exit", [True, False])
def test_batched_canvas_tokens_equal_alone_including_after_eos(eos_prone: Engine, early_exit: bool) -> None:
    params = eos_prone.params(
        {"gen_length": 16, "block_length": 8, "denoise_steps": 16, "temperature": 1.0, "early_exit": early_exit}
    )
    encoded = [eos_prone.encode_prompt(p) for p in PROMPTS * 2]
    together, _ = eos_prone.decode_ids(encoded, params, seeds=range(10))
    stops = eos_prone.special.stop_ids
    ended = [row for row in together if any(t in stops for t in row[:-1])]
    assert ended and len(ended) < len(together)  # some rows end early, some do not: the property is exercised
    for seed, (ids, row) in enumerate(zip(encoded, together)):
        alone, _ = eos_prone.decode_ids([ids], params, seeds=[seed])
        assert alone[0] == row  # the whole canvas, the part after the stop token included


def test_results_keep_input_order_and_carry_figures(engine: Engine) -> None:
    params = engine.params({"gen_length": 8, "block_length": 8, "denoise_steps": 4})
    results = engine.generate(PROMPTS, params, batch_size=2)
    assert [r.prompt for r in results] == PROMPTS
    r = results[0]
    assert r.prompt_tokens == len(engine.encode_prompt(PROMPTS[0]))
    assert r.nfe == 4 and r.denoise_steps == 4 and r.wall_s > 0
    assert r.device == "cpu" and r.dtype == "float32"
    assert r.settings["gen_length"] == 8


def test_same_seed_reproduces_sampled_output(engine: Engine) -> None:
    params = engine.params({"gen_length": 16, "block_length": 8, "denoise_steps": 8, "temperature": 1.0, "seed": 7})
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    c = engine.generate(PROMPTS, params.with_(seed=8))
    assert [r.text for r in a] == [r.text for r in b]
    assert [r.text for r in a] != [r.text for r in c]


class EosAfter(LogitsFake):
    """Fake at the model boundary: predicts token 9 everywhere, EOS from position `at` on."""

    def __init__(self, cfg, at: int) -> None:  # type: ignore[no-untyped-def]
        self.cfg, self.at = cfg, at

    def __call__(self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, self.cfg.vocab_size)
        logits[..., 9] = 1.0
        logits[..., self.cfg.eos_token_id] = (positions >= self.at).float() * 2
        return logits


def test_output_is_cut_at_the_first_eos(engine: Engine) -> None:
    fake_engine = Engine(EosAfter(engine.model.cfg, at=5), engine.tokenizer, engine.device, engine.dtype)  # type: ignore[arg-type]
    prompt_ids = engine.encode_prompt("床前")
    params = GenerationParams(gen_length=12, block_length=12, denoise_steps=12, strategy="reference")
    [r] = fake_engine.generate(["床前"], params)
    assert r.finish_reason == "stop"
    assert r.output_tokens == 5 - len(prompt_ids)
    assert r.text == engine.tokenizer.decode([9] * r.output_tokens)
    [r] = Engine(
        EosAfter(engine.model.cfg, at=10**6),
        engine.tokenizer,
        engine.device,  # type: ignore[arg-type]
        engine.dtype,
    ).generate(["床前"], params)
    assert r.finish_reason == "length" and r.output_tokens == 12


def test_prompt_longer_than_context_is_a_user_error(engine: Engine) -> None:
    with pytest.raises(UsageError, match="context"):
        engine.generate(["床" * 300], engine.params({"gen_length": 8}))


def test_unknown_and_mistyped_request_params_are_named(engine: Engine) -> None:
    with pytest.raises(UsageError, match="unknown generation parameter 'stepz'"):
        engine.params({"stepz": 3})
    with pytest.raises(UsageError, match="gen_length must be an integer"):
        engine.params({"gen_length": "8"})
    with pytest.raises(UsageError, match="strategy: unknown value 'warp'"):
        engine.generate(["x"], engine.params({"strategy": "warp"}))


def test_model_generation_config_sets_defaults(tmp_path: Path, tiny_model: Path) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text('{"denoise_steps": 5, "temperature": 0.5}')
    e = load_engine(folder, device="cpu", dtype="float32")
    assert e.params().denoise_steps == 5 and e.params({"temperature": 0}).temperature == 0.0


@pytest.mark.parametrize("model", ["celeris-block", "celeris-tiny"])
def test_the_shipped_generation_config_is_valid(model: str) -> None:
    """Each embedded model's defaults parse (no unknown key, no wrong type, every range rule holds)."""
    import json

    from celeris_cli.engine import embedded_models
    from celeris_cli.params import script_layers

    raw = json.loads((embedded_models()[model] / "generation_config.json").read_text(encoding="utf-8"))
    presets = script_layers(raw)  # each script's settings checked too
    raw.pop("by_script", None)
    params = GenerationParams.from_mapping(raw)
    assert {k: getattr(params, k) for k in raw} == raw
    for layer in presets.values():
        assert {k: getattr(params.as_defaults().under(layer), k) for k in layer} == layer


@pytest.mark.parametrize("model", ["celeris-tiny", "celeris-block"])
def test_the_readme_english_prompts_get_answers_without_a_word_three_times_in_a_row(model: str) -> None:
    """Issue #14's acceptance at each embedded model's shipped defaults (seed 0; float32, so that the check
    does not depend on the machine's bf16 support): a non-empty answer, no word more than twice in a row."""
    import re

    engine = load_engine(model, device="cpu", dtype="float32")
    prompts = ["The jury said it", "Shall I compare thee to a summer's day?"]
    for r in engine.generate(prompts, engine.params({})):
        words = re.findall(r"\w+", r.text.lower())
        assert words, (model, r.prompt)
        assert not any(a == b == c for a, b, c in zip(words, words[1:], words[2:])), (model, r.text)
