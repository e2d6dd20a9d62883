"""LLaDA2-MoE, against outputs of its own modeling code (modeling_llada2_moe.py, with its `generate`) on a
tiny checkpoint saved by `save_pretrained`, made in a scratch environment outside this project (provenance,
and the two documented shims around the reference `generate`, in the JSON).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model, read_folder
from celeris_cli.arch.llada2 import LLaDA2MoeModel
from celeris_cli.decode.block import block_mask
from celeris_cli.decode.strategies import SpecialTokens
from celeris_cli.errors import UsageError

DATA = Path(__file__).parent / "data" / "llada2"
FOLDER = DATA / "llada2_tiny"
REF = json.loads((DATA / "llada2_reference.json").read_text(encoding="utf-8"))
EOS = REF["ids"]["eos"]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def test_config_json_chooses_llada2_its_block_strategies_and_special_ids(engine) -> None:  # type: ignore[no-untyped-def]
    arch, cfg = read_folder(FOLDER)
    assert arch.name == "llada2_moe" and arch.strategies == ("block-fast", "block")
    assert (cfg.mask_token_id, cfg.eos_token_id) == (REF["ids"]["mask"], EOS)
    assert engine.params().strategy == "block-fast" and engine.params().threshold == 0.95
    assert engine.tokenizer.eot_id == engine.tokenizer.backend.find("<|role_end|>")  # end of turn, from the tokenizer


def test_tensor_names_as_its_code_saves_them_load_without_renaming() -> None:
    from safetensors import safe_open

    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    model = load_model(FOLDER)
    assert isinstance(model, LLaDA2MoeModel)
    assert saved == set(model.state_dict())
    layer0, layer1 = "model.layers.0.", "model.layers.1.mlp."
    for name in ("attention.query_key_value.weight", "attention.query_layernorm.weight", "mlp.gate_proj.weight"):
        assert layer0 + name in saved  # layer 0 is dense
    for name in ("gate.weight", "gate.expert_bias", "shared_experts.up_proj.weight", "experts.7.down_proj.weight"):
        assert layer1 + name in saved


def test_logits_under_the_block_causal_mask_equal_the_reference_in_float32() -> None:
    from safetensors.torch import load_file

    model = load_model(FOLDER)
    expected = load_file(str(DATA / "logits.safetensors"))
    ids = expected["input_ids"]
    real = torch.ones_like(ids, dtype=torch.bool)
    L = ids.shape[1]
    for width in (8, 4):
        got = model(ids, block_mask(real, 0, L, L, width), expected["position_ids"].expand_as(ids))
        torch.testing.assert_close(got, expected[f"logits_block{width}"], atol=1e-4, rtol=1e-4)


def test_router_chooses_with_the_bias_and_weighs_without_it() -> None:
    from safetensors.torch import load_file

    model = load_model(FOLDER)
    expected = load_file(str(DATA / "logits.safetensors"))
    for layer in (1, 2):
        gate = model.model.layers[layer].mlp.gate
        chosen, weights = gate(expected[f"router.layer{layer}.gate_input"].reshape(-1, gate.weight.shape[1]))
        want_idx = expected[f"router.layer{layer}.topk_idx"].reshape(chosen.shape)
        assert torch.equal(chosen.sort(-1).values, want_idx.sort(-1).values)
        want_w = expected[f"router.layer{layer}.topk_weight"].reshape(weights.shape)
        torch.testing.assert_close(weights.gather(1, chosen.argsort(-1)), want_w.gather(1, want_idx.argsort(-1)))
    # the bias matters: without it, some tokens would choose other experts
    gate = model.model.layers[1].mlp.gate
    x = expected["router.layer1.gate_input"].reshape(-1, gate.weight.shape[1])
    with_bias = gate(x)[0].sort(-1).values
    gate.expert_bias.zero_()
    assert not torch.equal(gate(x)[0].sort(-1).values, with_bias)


def _settings(kw: dict, strategy: str) -> dict:  # type: ignore[type-arg]
    steps = min(kw["steps"], kw["gen_length"] // kw.get("minimal_topk", 1))  # generate()'s own cap
    return {
        "strategy": strategy,
        "gen_length": kw["gen_length"],
        "block_length": kw["block_length"],
        "block_steps": steps,
        "threshold": kw.get("threshold", 0.95),
        "temperature": kw["temperature"],
    }


def _through_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


CASES = REF["generate"]["cases"]


@pytest.mark.parametrize("strategy", ["block", "block-fast"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['prompt']}-{c['setting']}")
def test_greedy_generation_equals_llada2_generate(engine, case, strategy) -> None:  # type: ignore[no-untyped-def]
    """The reference stops only at its eos_id (some cases pass an unused id to decode every block)."""
    kw = case["generate_kwargs"]
    engine.special = SpecialTokens(engine.tokenizer.mask_id, frozenset({kw["eos_id"]}), engine.tokenizer.pad_id)
    try:
        outs, _ = engine.decode_ids([case["input_ids"]], engine.params(_settings(kw, strategy)))
    finally:
        engine.special = SpecialTokens(engine.tokenizer.mask_id, engine.tokenizer.stop_ids, engine.tokenizer.pad_id)
    assert _through_eos(outs[0], kw["eos_id"]) == case["generated_ids"]


def _prompts(n: int) -> list[list[int]]:
    seen: dict[str, list[int]] = {}
    for c in CASES:
        seen.setdefault(c["prompt"], c["input_ids"])
    return list(seen.values())[:n]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("strategy", ["block", "block-fast"])
def test_batched_rows_equal_each_row_alone(engine, strategy, temperature) -> None:  # type: ignore[no-untyped-def]
    """Rows of different prompt lengths (so different block alignments) decoded together: no row's answer
    moves, and the MoE drops no token whatever its batch mates route to."""
    prompts = _prompts(5)
    assert len({len(p) % 8 for p in prompts}) > 1
    params = engine.params(
        {"strategy": strategy, "gen_length": 32, "block_length": 8, "block_steps": 8, "temperature": temperature}
    )
    together, _ = engine.decode_ids(prompts, params)
    alone = [engine.decode_ids([p], params)[0][0] for p in prompts]
    cut = [engine.finish(o)[0] for o in together], [engine.finish(o)[0] for o in alone]
    assert cut[0] == cut[1]


def test_the_cached_decoder_computes_far_fewer_positions(engine) -> None:  # type: ignore[no-untyped-def]
    """block-fast computes the current block only (the prompt once); the reference recomputes the prefix."""
    from celeris_cli.decode.strategies import Net

    seen: dict[str, int] = {}

    class Counting(Net):
        def hidden(self, ids, positions, key_mask, cache=None, start=0, keep_kv=True):  # type: ignore[no-untyped-def]
            seen[self.name] = seen.get(self.name, 0) + ids.numel()
            return super().hidden(ids, positions, key_mask, cache, start, keep_kv)

    prompt = _prompts(1)[0]
    unused = SpecialTokens(engine.tokenizer.mask_id, frozenset({REF["ids"]["vocab_size"] - 1}), 0)  # every block runs
    for strategy in ("block", "block-fast"):
        params = engine.params({"strategy": strategy, "gen_length": 32, "block_length": 8, "block_steps": 8})
        net = Counting(engine.model)
        net.name = strategy  # type: ignore[attr-defined]
        from celeris_cli.decode.sampling import RowNoise
        from celeris_cli.decode.strategies import get_strategy

        P = len(prompt)
        get_strategy(strategy)(
            net, torch.tensor([prompt]), torch.ones(1, P, dtype=torch.bool), params, unused, RowNoise([0], "cpu")
        )
    assert seen["block-fast"] * 2 < seen["block"]


def test_block_strategies_only_run_block_models_and_reject_other_knobs(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="does not run on the llada2_moe"):
        engine.params({"strategy": "fast"})
    with pytest.raises(UsageError, match="cache"):
        engine.params({"cache": "prefix"})


def test_every_block_knob_changes_the_answer(engine) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts(7)
    base = {"gen_length": 32, "block_length": 8, "block_steps": 8, "threshold": 1.0, "temperature": 0.0}
    ref, _ = engine.decode_ids(prompts, engine.params(base))
    changes = {"block_length": 16, "block_steps": 2, "threshold": 0.3, "temperature": 1.0, "top_k": 3}
    changes |= {"cfg_scale": 2.0, "remasking": "random", "order_temperature": 2.0}
    for knob, value in changes.items():
        outs, _ = engine.decode_ids(prompts, engine.params({**base, knob: value, "seed": 1}))
        assert outs != ref, knob
    by_total = dict(base)
    del by_total["block_steps"]
    for steps in (4, 12):  # 4 blocks: one step each, or three
        outs, _ = engine.decode_ids(prompts, engine.params({**by_total, "denoise_steps": steps}))
        assert outs != ref, steps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guidance_and_remasking_give_the_same_answers_with_the_cache(engine, temperature) -> None:  # type: ignore[no-untyped-def]
    """The unconditional view's cache is exact as the canvas's is: block-fast gives block's answers under
    guidance, random remasking, order noise and a total of steps spread per row, in a batch of rows whose
    prompts end at different places in their blocks."""
    prompts = _prompts(5)
    assert len({len(p) % 8 for p in prompts}) > 1
    settings = [
        {"cfg_scale": 1.5, "block_steps": 8},
        {"remasking": "random", "block_steps": 4},
        {"order_temperature": 1.0, "cfg_scale": 0.5, "denoise_steps": 13},
    ]
    for extra in settings:
        knobs = {"gen_length": 32, "block_length": 8, "threshold": 0.9, "temperature": temperature, "seed": 2} | extra
        outs = [engine.decode_ids(prompts, engine.params({**knobs, "strategy": s}))[0] for s in ("block", "block-fast")]
        cut = [[engine.finish(o)[0] for o in out] for out in outs]
        assert cut[0] == cut[1], extra
        alone = [engine.finish(engine.decode_ids([p], engine.params(knobs))[0][0])[0] for p in prompts]
        assert alone == cut[1], extra  # and no row's answer moves with its batch mates


def test_guidance_hides_exactly_the_prompt() -> None:
    """A guided row's unconditional view (`running._Row.unconditional`) shows every prompt position as a mask
    and every answer position as it is, in any window of its canvas."""
    from celeris_cli.decode.running import _Row
    from celeris_cli.decode.runset import RowRequest
    from celeris_cli.decode.strategies import plan_for
    from celeris_cli.params import GenerationParams

    params = GenerationParams.from_mapping({"strategy": "block", "cfg_scale": 1.0, "gen_length": 8, "block_length": 4})
    for prompt in ([5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]):
        P = len(prompt)
        x = torch.tensor(prompt + [9] * 8)  # answer positions committed since (the view reads the canvas live)
        row = _Row(RowRequest(0, prompt, plan_for(params), 0), x, [], P // 4, P // 4, plan_for(params))
        assert row.unconditional(0, len(x), 1).tolist() == [1] * P + [9] * 8  # the prompt masked, the answer as it is
        lo = P - 2  # a window that starts inside the prompt
        assert row.unconditional(lo, len(x), 1).tolist() == [1, 1] + [9] * 8


def test_denoise_steps_are_the_total_over_each_rows_blocks(engine) -> None:  # type: ignore[no-untyped-def]
    """With denoise_steps, each answer reports the steps its own blocks were scheduled (a prompt that ends
    inside a block decodes one block more), summing to the total asked where every block can take its
    share; more steps take more forwards."""
    prompts = _prompts(5)
    nfe = []
    for steps in (4, 8, 16, 32):
        params = engine.params({"gen_length": 32, "block_length": 8, "threshold": 1.0, "denoise_steps": steps})
        results = engine.decode_batch([str(i) for i in range(len(prompts))], prompts, params, presets=False)
        for r, ids in zip(results, prompts):
            assert r.steps_per_block == params.steps_for(len(ids)) and r.denoise_steps == sum(r.steps_per_block)
            assert len(r.steps_per_block) == (4 if len(ids) % 8 == 0 else 5)
            assert r.settings["denoise_steps"] == steps and "block_steps" not in r.settings
            if steps == 16 and len(ids) % 8 <= 4:  # shares of 4 (or 4,3,3,3,3): each block's tokens can take them
                assert r.denoise_steps == 16
        nfe.append(results[0].nfe)
    assert nfe == sorted(nfe) and nfe[0] < nfe[-1]


@pytest.mark.parametrize("strategy", ["block", "block-fast"])
def test_block_decoders_honour_presence_penalty_and_min_tokens(engine, strategy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One commit per step (threshold never fires), greedy: with a prohibitive presence penalty no token
    comes twice in an answer; with min_tokens N, a stop token the answer would start with waits until N."""
    prompts = _prompts(4)
    vocab = REF["ids"]["vocab_size"]
    monkeypatch.setattr(engine, "special", SpecialTokens(engine.tokenizer.mask_id, frozenset({vocab - 1}), 0))
    base = {"strategy": strategy, "gen_length": 32, "block_length": 8, "block_steps": 8, "threshold": 1.0}
    base["temperature"] = 0.0
    plain, _ = engine.decode_ids(prompts, engine.params(base))
    assert any(len(set(a)) < len(a) for a in plain)  # greedy answers repeat themselves
    penalised, _ = engine.decode_ids(prompts, engine.params({**base, "presence_penalty": 1e4}))
    assert all(len(set(a)) == len(a) for a in penalised)

    first = plain[0][0]  # make the first answer's first token a stop token: that answer ends at once
    monkeypatch.setattr(engine, "special", SpecialTokens(engine.tokenizer.mask_id, frozenset({first}), 0))
    ended, _ = engine.decode_ids(prompts, engine.params(base))
    assert ended[0][0] == first
    held, _ = engine.decode_ids(prompts, engine.params({**base, "min_tokens": 5}))
    assert all(first not in a[:5] for a in held)


@pytest.mark.parametrize("strategy", ["block", "block-fast"])
def test_block_decoders_honour_subword_min_p(engine, strategy) -> None:  # type: ignore[no-untyped-def]
    """Sampled, one commit per step: with the rule strict, the pieces that continue a word (held to 0.9 of
    their position's likeliest token) become rarer in the answers, and the answers change."""
    prompts = [engine.encode_prompt(p) for p in ("The quick brown", "To be, or not", "Once upon a", "It was")]
    base = {"strategy": strategy, "gen_length": 32, "block_length": 8, "block_steps": 8, "threshold": 1.0}
    base |= {"temperature": 1.0, "seed": 3}
    plain, _ = engine.decode_ids(prompts, engine.params(base))
    strict, _ = engine.decode_ids(prompts, engine.params({**base, "subword_min_p": 0.9}))
    assert strict != plain
    pieces = engine.tokenizer.word_pieces
    share = [sum(t in pieces for a in out for t in a) / sum(map(len, out)) for out in (plain, strict)]
    assert share[1] < share[0]
