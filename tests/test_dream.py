"""Dream, against outputs of Dream's own code (modeling_dream.py, generation_utils.py) on a tiny checkpoint
saved by `save_pretrained`, made in a scratch environment outside this project (provenance in the JSON).

The folder is as transformers writes it: config.json, generation_config.json, model.safetensors, and Qwen2's
tokenizer files (vocab.json, merges.txt, tokenizer_config.json with the added tokens and the chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model, read_folder
from celeris_cli.arch.dream import DreamModel
from celeris_cli.decode.strategies import Net
from celeris_cli.errors import UsageError

DATA = Path(__file__).parent / "data" / "dream"
FOLDER = DATA / "dream_tiny"
REF = json.loads((DATA / "dream_reference.json").read_text(encoding="utf-8"))
TOK = json.loads((DATA / "tokenizer_reference.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def test_config_json_chooses_the_dream_architecture_and_its_special_ids() -> None:
    arch, cfg = read_folder(FOLDER)
    assert arch.name == "dream" and cfg.model_type == "Dream"
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (599, 576, 576)


def test_tensor_names_as_dreams_code_saves_them_load_without_renaming() -> None:
    from safetensors import safe_open

    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    model = load_model(FOLDER)
    assert isinstance(model, DreamModel)
    assert saved == set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.bias" in saved and "model.layers.0.self_attn.o_proj.bias" not in saved


def test_logits_equal_dreams_forward_in_float32() -> None:
    from safetensors.torch import load_file

    model = load_model(FOLDER)
    expected = load_file(str(DATA / "logits.safetensors"))
    checked = 0
    for entry in REF["logits"]["entries"]:
        ids = torch.tensor(entry["input_ids"])
        mask = torch.tensor(entry.get("attention_mask_2d", [[1] * ids.shape[1]] * ids.shape[0])).bool()
        logits = model(ids, mask, Net.positions(mask))
        real = mask  # left padding: pad rows attend to nothing in Dream's code; only real positions compare
        torch.testing.assert_close(logits[real], expected[entry["name"] + ".logits"][real], atol=1e-4, rtol=1e-4)
        checked += int(real.sum())
    assert checked > 100


def test_tokenizer_encodes_as_transformers_qwen2_tokenizer(engine) -> None:  # type: ignore[no-untyped-def]
    assert TOK["encode"], "no tokenizer cases"
    for case in TOK["encode"]:
        assert engine.tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert engine.tokenizer.backend.decode(case["ids"]) == case["decode"]  # (Tokenizer.decode drops masks)
    for name, spec in TOK["special"].items():
        if spec["id"] is not None:
            assert engine.tokenizer.backend.find(spec["token"]) == spec["id"], name


def test_chat_template_renders_as_transformers_does(engine) -> None:  # type: ignore[no-untyped-def]
    assert TOK["chat"]
    for case in TOK["chat"]:
        text = engine.tokenizer.render_chat(case["messages"])
        assert text == case["text"]
        assert engine.tokenizer.encode(text) == case["ids"]


def _settings(s: dict) -> dict:  # type: ignore[type-arg]
    out = {
        "strategy": "dream",
        "gen_length": s["max_new_tokens"],
        "denoise_steps": s["steps"],
        "alg": s["alg"],
        "alg_temp": s["alg_temp"] or 0.0,
        "temperature": s["temperature"],
        "eps": s["eps"],
    }
    if s.get("top_p") is not None:
        out["top_p"] = s["top_p"]
    if s.get("top_k") is not None:
        out["top_k"] = s["top_k"]
    return out


def _cases() -> list[dict]:  # type: ignore[type-arg]
    """Every case whose reference run had no exact tie in confidence: torch.topk orders ties as it likes
    (top_k=1 or a tight top_p make every candidate's probability 1), so those runs are not exact targets."""
    return [c for c in REF["cases"] + REF["top_p_top_k_temperature0"] if not any(c["tie_flags"].values())]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"case{c['id']}")
def test_greedy_generation_equals_dreams_diffusion_generate(engine, case) -> None:  # type: ignore[no-untyped-def]
    params = engine.params(_settings(case["settings"]))
    prompts = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(case["input_ids"], case["attention_mask"])]
    outs, _ = engine.decode_ids(prompts, params)
    assert outs == case["generated_ids"]


def test_batched_rows_equal_the_same_prompts_alone(engine) -> None:  # type: ignore[no-untyped-def]
    batch = next(c for c in REF["cases"] if c["batch"])
    params = engine.params(_settings(batch["settings"]))
    prompts = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    together, _ = engine.decode_ids(prompts, params)
    alone = [engine.decode_ids([p], params)[0][0] for p in prompts]
    assert together == alone


def test_each_dream_alg_changes_the_answer(engine) -> None:  # type: ignore[no-untyped-def]
    ids = engine.encode_prompt("The quick brown fox")
    outs = {
        alg: engine.decode_ids([ids], engine.params({"strategy": "dream", "alg": alg, "gen_length": 32, "steps": 8}))[
            0
        ][0]
        for alg in ("maskgit_plus", "topk_margin", "entropy", "origin")
    }
    assert len({tuple(v) for v in outs.values()}) >= 3


def test_alg_temp_draws_positions_per_request_seed(engine) -> None:  # type: ignore[no-untyped-def]
    prompts = [engine.encode_prompt(p) for p in ("def add(a, b):\n", "The quick brown fox", "床前明月光，")]
    base = {"strategy": "dream", "gen_length": 32, "steps": 8, "alg": "maskgit_plus"}  # the folder's is origin
    greedy, _ = engine.decode_ids(prompts, engine.params(base))
    drawn = [engine.decode_ids(prompts, engine.params({**base, "alg_temp": 5.0, "seed": s}))[0] for s in (1, 1, 2)]
    assert drawn[0] == drawn[1]  # the same request gives the same answer
    assert drawn[0] != greedy and drawn[2] != drawn[0]


def test_fast_strategy_handles_the_logit_shift(engine) -> None:  # type: ignore[no-untyped-def]
    """With one token per step and no threshold, the fast decoder (no cache: its full-canvas path) must make
    the reference decoder's choices; a decoder that ignored the shift would not. The cached window's shift
    is pinned by the one-layer test below."""
    ids = engine.encode_prompt("床前明月光，")
    common = {"gen_length": 16, "block_length": 16, "steps": 16, "temperature": 0.0}
    ref = engine.decode_ids([ids], engine.params({**common, "strategy": "reference"}))[0][0]
    fast = engine.decode_ids(
        [ids], engine.params({**common, "strategy": "fast", "cache": "none", "threshold": 1.0, "early_exit": False})
    )[0][0]
    assert fast == ref


def test_dream_decoding_is_rejected_by_name_on_a_block_model_or_with_llada_knobs(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="block_length"):
        engine.params({"strategy": "dream", "block_length": 8})
    with pytest.raises(UsageError, match="alg"):
        engine.params({"strategy": "fast", "alg": "entropy"})


@pytest.mark.parametrize("cfg_scale", [0.0, 2.0])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_cached_window_handles_the_shift_exactly_on_a_one_layer_model(cache: str, cfg_scale: float) -> None:
    """With one layer a cache is exact (keys/values depend on each position's own token), so the cached
    decoder must reproduce the uncached one; the window must start one position early for the shift."""
    from celeris_cli.engine import Engine

    full = load_engine(FOLDER, device="cpu", dtype="float32")
    full.model.model.layers = full.model.model.layers[:1]
    one = Engine(full.model, full.tokenizer, full.device, full.dtype, FOLDER, full.arch)
    base = {"gen_length": 24, "block_length": 8, "steps": 24, "threshold": 0.95, "early_exit": False, "temperature": 0}
    base["cfg_scale"] = cfg_scale  # guidance: the unconditional view's window must not see the prompt either
    prompts = [one.encode_prompt(p) for p in ("床前明月光，", "def add(a, b):\n", "The quick brown fox")]
    plain, _ = one.decode_ids(prompts, one.params({**base, "cache": "none"}))
    cached, _ = one.decode_ids(prompts, one.params({**base, "cache": cache}))
    assert cached == plain


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0},
        {"alg": "origin"},
        {"alg": "topk_margin", "alg_temp": 0.5},
        {"alg": "entropy", "temperature": 0.7, "top_p": 0.9},
    ],
    ids=["sampled", "origin", "alg_temp", "entropy-top_p"],
)
def test_every_random_draw_depends_on_the_request_alone(engine, settings) -> None:  # type: ignore[no-untyped-def]
    """Prompts of very different lengths batched together: each row's answer equals its answer alone."""
    prompts = [engine.encode_prompt(p) for p in ("床前明月光，疑是地上霜。举头望明月，", "To", "def add(a, b):\n")]
    params = engine.params({"strategy": "dream", "gen_length": 24, "steps": 8, "seed": 3, **settings})
    together, _ = engine.decode_ids(prompts, params)
    alone = [engine.decode_ids([p], params)[0][0] for p in prompts]
    assert together == alone


def test_dream_settings_rules(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="alg_temp: origin"):
        engine.params({"strategy": "dream", "alg": "origin", "alg_temp": 0.5})
    # Dream's schedule may commit nothing on a step: more steps than tokens is allowed, as in its own code
    assert engine.params({"strategy": "dream", "gen_length": 16, "steps": 32}).denoise_steps == 32


def test_eps_changes_the_schedule_and_the_answer(engine) -> None:  # type: ignore[no-untyped-def]
    """eps ends Dream's time schedule: a large one commits more tokens early, which changes what follows."""
    prompts = [engine.encode_prompt(p) for p in ("def add(a, b):\n", "The quick brown fox", "床前明月光，")]
    base = {"strategy": "dream", "gen_length": 24, "steps": 8, "alg": "maskgit_plus"}
    small, _ = engine.decode_ids(prompts, engine.params({**base, "eps": 0.001}))
    large, _ = engine.decode_ids(prompts, engine.params({**base, "eps": 0.6}))
    assert small != large
