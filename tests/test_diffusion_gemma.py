"""DiffusionGemma against transformers 5.23.0's own classes and `generate` (tests/data/diffusion_gemma, README there).

The folder was saved by `DiffusionGemmaForBlockDiffusion.save_pretrained`; the logits are its forward's, the runs
its `generate`'s for a batch of one. Greedy-limit runs (t_min 0, t_max 1e-5) depend on their starting canvases
only, which `initial_canvases` pins; sampled runs draw from torch's CPU generator, which `noise: torch` follows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.arch.checkpoint import load_model
from celeris_cli.arch.diffusion_gemma import DiffusionGemmaModel
from celeris_cli.cli import app
from celeris_cli.decode.diffusion_gemma import Context
from celeris_cli.decode.strategies import Net

DATA = Path(__file__).parent / "data" / "diffusion_gemma"
FOLDER = DATA / "diffusion_gemma_tiny"
REF = json.loads((DATA / "diffusion_gemma_reference.json").read_text(encoding="utf-8"))
# generate's keyword -> Celeris's setting
KEYS = {
    "max_new_tokens": "gen_length",
    "t_min": "temperature_final",
    "t_max": "temperature",
    "max_denoising_steps": "block_steps",
    "eos_token_id": "stop_token_ids",
}


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def request(case: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """A `celeris batch` request line for a recorded run: its prompt and settings under Celeris's names."""
    r = {KEYS.get(k, k): v for k, v in case["settings"].items()}
    r |= {"prompt": REF["prompts"][case["prompt"]], "block_length": case["block_length"], "seed": case["seed"]}
    if greedy:
        r["initial_canvases"] = case["initial_canvases"]
    else:  # its own draws; where its first canvas was given (`decoder_input_ids`), that one
        r["noise"] = "torch"
        if case.get("pinned_first_canvas"):
            r["initial_canvases"] = case["initial_canvases"][:1]
    return r


def expected_text(engine: Any, case: dict[str, Any]) -> str:
    return str(engine.tokenizer.continuation(case["input_ids"], case["answer_ids"]))


def test_tensor_names_are_the_saved_ones_and_the_vision_tower_is_skipped() -> None:
    from safetensors import safe_open

    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    model = load_model(FOLDER)
    assert isinstance(model, DiffusionGemmaModel)
    text = {k for k in saved if not k.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision."))}
    assert text == set(model.state_dict()) and len(saved) > len(text)


def test_decoder_logits_with_and_without_self_conditioning_and_after_commits_match_transformers() -> None:
    from safetensors.torch import load_file

    expected = load_file(str(DATA / "logits.safetensors"))
    net = Net(load_model(FOLDER))
    with torch.no_grad():
        for c in REF["logits"]:
            k, ids = c["prompt"], torch.tensor([c["input_ids"]])
            ctx = Context(net, ids, torch.ones_like(ids, dtype=torch.bool))
            canvas = torch.tensor([c["canvases"][0]])
            plain = ctx.denoise(canvas, None)[0]
            torch.testing.assert_close(plain, expected[f"{k}.no_self_conditioning"], atol=1e-4, rtol=0)
            signal = expected[f"{k}.no_self_conditioning"][None] / c["self_conditioning_temperature"]
            conditioned = ctx.denoise(canvas, signal)[0]
            torch.testing.assert_close(conditioned, expected[f"{k}.with_self_conditioning"], atol=1e-4, rtol=0)
            assert (conditioned - plain).abs().max() > 1e-2  # the signal changes the answer
            for j, after in enumerate(c["after_commits"]):  # each commit pass goes past the sliding window of 4
                ctx.commit(torch.tensor([after["committed"]]))
                logits = ctx.denoise(torch.tensor([after["canvas"]]), None)[0]
                torch.testing.assert_close(logits, expected[f"{k}.after_commit_{j + 1}"], atol=1e-4, rtol=0)


def _batch(tmp_path: Path, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(json.dumps({"custom_id": str(i), **r}) + "\n" for i, r in enumerate(lines)))
    result = CliRunner().invoke(
        app, ["batch", "-i", str(src), "-o", str(out), "--model", str(FOLDER), "--dtype", "float32"]
    )
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_every_recorded_run_is_token_exact_through_celeris_batch(engine: Any, tmp_path: Path, kind: str) -> None:
    cases = REF[kind]
    results = _batch(tmp_path, [request(c, kind == "greedy") for c in cases])
    assert len(results) == len(cases)
    for case, got in zip(cases, results):
        assert got["response"]["body"]["text"] == expected_text(engine, case), (case["prompt"], case["settings"])


def test_generate_takes_the_initial_canvases_file_and_the_torch_noise(engine: Any, tmp_path: Path) -> None:
    greedy = next(c for c in REF["greedy"] if len(c["initial_canvases"]) == 3)
    canvases = tmp_path / "canvases.json"
    canvases.write_text(json.dumps(greedy["initial_canvases"]))
    r = request(greedy, True)
    args = ["generate", "--model", str(FOLDER), "--prompt", r["prompt"], "--json", "--quiet", "--dtype", "float32"]
    flags = ["--gen-length", str(r["gen_length"]), "--block-length", str(r["block_length"]), "--temperature", "1e-5"]
    flags += ["--temperature-final", "0", "--initial-canvases", str(canvases)]
    p = CliRunner().invoke(app, args + flags)
    assert p.exit_code == 0, p.output
    assert json.loads(p.stdout)["text"] == expected_text(engine, greedy)
    sampled = next(c for c in REF["sampled"] if c["settings"] == {"max_new_tokens": 16} and c["seed"] == 1)
    flags = ["--noise", "torch", "--seed", "1", "--gen-length", "16"]
    p = CliRunner().invoke(app, ["generate", "--model", str(FOLDER), "--prompt", REF["prompts"][sampled["prompt"]]]
                           + args[5:] + flags)  # fmt: skip
    assert p.exit_code == 0, p.output
    assert json.loads(p.stdout)["text"] == expected_text(engine, sampled)


def test_an_answer_alone_equals_the_same_answer_beside_others(engine: Any) -> None:
    """Default noise: each row draws from its own stream and is frozen when it finishes, so batch mates of
    other lengths change nothing (rule 2)."""
    prompts = [REF["prompts"][k] for k in ("plain", "chat", "count", "letters")]
    params = engine.params({"gen_length": 24, "block_steps": 12, "seed": 3})
    together = [r.text for r in engine.generate(prompts, params, batch_size=4)]
    alone = [engine.generate([p], params, batch_size=1)[0].text for p in prompts]
    assert together == alone and len(set(alone)) == len(alone)


def test_chat_with_the_folders_defaults(engine: Any) -> None:
    p = CliRunner().invoke(
        app, ["generate", "--model", str(FOLDER), "--chat", "--prompt", "hello", "--json", "--quiet"]
    )
    assert p.exit_code == 0, p.output
    r = json.loads(p.stdout)
    assert r["settings"]["gen_length"] == 16 and r["settings"]["block_length"] == 8  # generation_config, config.json
    assert r["settings"]["temperature"] == 0.8 and r["settings"]["entropy_bound"] == 0.1


def test_an_answer_shorter_than_the_canvas_is_one_whole_canvas(engine: Any) -> None:
    """As its generate: max_new_tokens 3 with a canvas of 8 decodes one canvas of 8."""
    params = engine.params({"gen_length": 3, "block_length": 8, "block_steps": 2})
    outs, nfe = engine.decode_ids([REF["greedy"][0]["input_ids"]], params)
    assert len(outs[0]) == 8 and nfe == 1 + 2


def test_the_adaptive_stop_and_the_step_cap_change_the_forwards(engine: Any) -> None:
    ids = [REF["greedy"][0]["input_ids"]]
    base = {"gen_length": 8, "block_length": 8, "temperature": 1e-5, "temperature_final": 0.0}
    _, capped = engine.decode_ids(ids, engine.params(base | {"block_steps": 5, "confidence_threshold": None}))
    _, early = engine.decode_ids(ids, engine.params(base | {"stability_threshold": 0}))
    assert capped == 1 + 5  # the prompt's pass and every step: no adaptive stop
    assert early == 1 + 1  # confident at once (one-hot), and no stability asked


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"threshold": 0.5}, "threshold: not used by the diffusion-gemma strategy"),
        ({"temperature": 0.3}, "temperature 0.3 must be above 0 and at least temperature_final 0.4"),
        ({"temperature": 0, "temperature_final": 0}, "temperature 0.0 must be above 0"),
        ({"initial_canvases": [[1, 2, 3]]}, "canvas 0 has 3 tokens; each must have block_length 8"),
        ({"initial_canvases": [[1] * 8] * 3}, "3 canvases given, but an answer of 16 tokens"),
        ({"confidence_threshold": 0}, "confidence_threshold must be a finite number > 0, or null"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be at most 64 token ids"),
        ({"noise": "numpy"}, "noise: unknown value 'numpy'"),
    ],
)
def test_settings_it_cannot_honour_are_refused_by_name(engine: Any, settings: dict[str, Any], words: str) -> None:
    from celeris_cli.errors import UsageError

    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace("[", r"\[")):
        engine.params(settings)


def test_stop_ids_come_as_a_list_an_id_or_a_flags_text(engine: Any) -> None:
    assert engine.params({"stop_token_ids": [5, 6]}).stop_token_ids == (5, 6)
    assert engine.params({"stop_token_ids": 5}).stop_token_ids == (5,)  # as transformers' eos_token_id may be
    from celeris_cli.params import parse_text

    assert parse_text("--stop-token-ids", "1, 106,50") == (1, 106, 50)


def test_a_pinned_token_outside_the_vocabulary_is_a_clear_error(tmp_path: Path) -> None:
    canvases = tmp_path / "c.json"
    canvases.write_text(json.dumps([[999] * 8]))
    p = CliRunner().invoke(
        app, ["generate", "--model", str(FOLDER), "--prompt", "a b", "--initial-canvases", str(canvases)]
    )
    assert p.exit_code != 0 and "token id 999 is outside the vocabulary of 320" in p.output
    p = CliRunner().invoke(
        app, ["generate", "--model", str(FOLDER), "--prompt", "a b", "--initial-canvases", "nope.json"]
    )
    assert p.exit_code != 0 and "--initial-canvases: cannot read nope.json" in p.output


def test_config_keys_are_type_checked_and_unknown_ones_refused_by_name(tmp_path: Path) -> None:
    from celeris_cli.arch.diffusion_gemma_config import DiffusionGemmaConfig
    from celeris_cli.errors import ModelError

    raw = json.loads((FOLDER / "config.json").read_text())
    DiffusionGemmaConfig.from_dict(raw)
    for change, words in (
        ({"sliding_window": 4.0}, "text_config.sliding_window must be an integer"),
        ({"attention_k_eq_v": False}, "text_config keys ['attention_k_eq_v'] are not supported"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all' is not supported"),
        ({"hidden_activation": "silu"}, "hidden_activation='silu' is not supported"),
    ):
        bad = {**raw, "text_config": {**raw["text_config"], **change}}
        with pytest.raises(ModelError, match=words.replace("[", r"\[")):
            DiffusionGemmaConfig.from_dict(bad)
    with pytest.raises(ModelError, match=r"keys \['canvas_size'\] are not supported"):
        DiffusionGemmaConfig.from_dict({**raw, "canvas_size": 8})
    with pytest.raises(ModelError, match="tie_word_embeddings=False is not supported"):
        DiffusionGemmaConfig.from_dict({**raw, "tie_word_embeddings": False})
    # the full layers' sizes as DiffusionGemmaTextConfig takes them, before it writes per_layer_config
    text = {k: v for k, v in raw["text_config"].items() if k != "per_layer_config"}
    text |= {"global_head_dim": 16, "num_global_key_value_heads": 1}
    assert DiffusionGemmaConfig.from_dict({**raw, "text_config": text}) == DiffusionGemmaConfig.from_dict(raw)


def test_inspect_reports_the_family_and_its_memory_estimate() -> None:
    p = CliRunner().invoke(app, ["inspect", str(FOLDER), "--json"])
    assert p.exit_code == 0, p.output
    info = json.loads(p.stdout)
    assert info["architecture"].startswith("diffusion_gemma") and info["canvas"].startswith("8 tokens")
    assert "2 of 4 experts" in info["active_parameters"] and "uniform random tokens" in info["noise"]
    p = CliRunner().invoke(app, ["inspect", str(FOLDER), "--memory"])
    assert p.exit_code == 0 and "expected peak (an estimate) for diffusion-gemma" in p.output  # test_canvas_memory


def test_a_run_under_a_memory_budget_decodes() -> None:
    """A budget is set on every CUDA run (its batches sized by the planner: test_canvas_memory)."""
    engine = load_engine(FOLDER, device="cpu", dtype="float32", max_memory="1GB")
    params = engine.params({"gen_length": 8, "block_steps": 2})
    assert len(engine.generate(["a b", "c d e"], params, batch_size=2)) == 2


def test_the_entropy_is_torchs_categorical_entropy_to_the_bit() -> None:
    from celeris_cli.decode.canvas_step import entropy

    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(5, 7, 320, generator=g) * 20
    scaled[0, 0, :300] = -torch.inf  # masked entries: p log p is 0 there, not nan
    assert torch.equal(entropy(scaled), torch.distributions.Categorical(logits=scaled).entropy())


def _step_at(chunk: int, signal: torch.Tensor | None, noise: str = "rows") -> Any:
    from celeris_cli.decode.canvas_step import CanvasDraws, canvas_step
    from celeris_cli.decode.sampling import RowNoise

    model = load_model(FOLDER)
    g = torch.Generator().manual_seed(1)
    prompt, canvas = torch.randint(5, 300, (3, 6), generator=g), torch.randint(5, 300, (3, 8), generator=g)
    ctx = Context(Net(model), prompt, torch.ones_like(prompt, dtype=torch.bool))
    draws = CanvasDraws(RowNoise([7, 8, 9], torch.device("cpu")), [7, 8, 9] if noise == "torch" else None, 320, "cpu")
    with torch.no_grad():
        h = ctx.hidden(canvas, signal)
        return canvas_step(model, h, canvas, signal, torch.tensor(0.7), draws, [0, 2], 0, 1, chunk, {2})


def test_a_steps_numbers_are_the_same_bits_whatever_the_chunk_of_positions() -> None:
    """The head, softmax, draws, entropies and self-conditioning input of a row, a chunk of positions at a time
    (1, 3 of a canvas of 8 with a ragged last chunk, the whole canvas): the same numbers, and the rows that are
    not live keep their inputs."""
    first = _step_at(8, None)
    signal = first.signal + 0.01 * torch.randn(first.signal.shape, generator=torch.Generator().manual_seed(2))
    for start in (None, signal):
        whole = _step_at(8, start)
        for chunk in (1, 3):
            part = _step_at(chunk, start)
            for name in ("drawn", "argmax", "entropy", "signal"):
                assert torch.equal(getattr(part, name), getattr(whole, name)), (chunk, name)
            assert all(torch.equal(a, b) for a, b in zip(part.whole[2], whole.whole[2]))
        assert whole.entropy[1].eq(0).all() and (start is None or torch.equal(whole.signal[1], start[1]))
    assert not torch.equal(_step_at(8, signal).signal, _step_at(8, None).signal)  # the signal is an input


def test_answers_are_the_same_whatever_the_chunk_of_positions() -> None:
    from celeris_cli.arch.folder import ModelFolder
    from celeris_cli.decode.diffusion_gemma import DiffusionGemmaPlan, generate_diffusion_gemma
    from celeris_cli.decode.sampling import RowNoise
    from celeris_cli.decode.strategies import _plan
    from celeris_cli.params import GenerationParams

    model = load_model(FOLDER)
    prompt = torch.randint(5, 300, (3, 5), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt, dtype=torch.bool)
    runs = {}
    for settings in ({"gen_length": 24, "block_steps": 6, "seed": 1}, {"gen_length": 16, "confidence_threshold": None}):
        params = GenerationParams.from_mapping(settings, ModelFolder.open(FOLDER).defaults())
        for chunk in (1, 3, None):
            plan = _plan(DiffusionGemmaPlan, params)
            noise = RowNoise([11, 12, 13], torch.device("cpu"))
            out = generate_diffusion_gemma(Net(model), prompt, mask, plan, frozenset({1}), 0, noise, chunk=chunk)
            runs[(str(settings), chunk)] = out
    for (settings, chunk), out in runs.items():
        assert torch.equal(out, runs[(settings, None)]), (settings, chunk)
    assert len({str(v.tolist()) for v in runs.values()}) == 2


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts_are_each_expert_within_a_step_of_its_weights_and_run_as_dequantized(scheme: str) -> None:
    """Loaded quantized (`QuantizedExperts`): each expert's matrices dequantize to within half a quantization step
    of the float ones (int8: max|w| / 127 a row; int4: a group's range / 15), and the layer's experts compute
    with exactly those matrices."""
    from celeris_cli.arch.gemma4 import Experts
    from celeris_cli.arch.quantize import QuantizedExperts

    full, quant = load_model(FOLDER).model.decoder.layers[1].experts, None
    quant = load_model(FOLDER, quantize=scheme).model.decoder.layers[1].experts
    assert isinstance(quant, QuantizedExperts) and not isinstance(full, QuantizedExperts)
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(full, name).detach()
        for e in range(w.shape[0]):
            got = quant.matrix(name, e)
            group = quant.groups[name]
            if group is None:
                step = w[e].abs().amax(1, keepdim=True) / 127
            else:
                g = w[e].view(w.shape[1], -1, group)
                step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(group, 1)
            assert ((got - w[e]).abs() <= step / 2 + 1e-6).all(), (name, e)
            assert (got != w[e]).any()  # quantized, not the float weights kept
    assert quant.groups["gate_up_proj"] == (32 if scheme == "int4" else None)
    dense = Experts.__new__(Experts)
    torch.nn.Module.__init__(dense)
    for name in ("gate_up_proj", "down_proj"):
        stack = torch.stack([quant.matrix(name, e) for e in range(quant.num_experts)])
        setattr(dense, name, torch.nn.Parameter(stack))
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    experts, weights = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 1], [0, 3]]), torch.rand(6, 2)
    with torch.no_grad():
        torch.testing.assert_close(quant(x, weights, experts), dense(x, weights, experts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_canvases_answer_alone_as_in_a_batch_in_bfloat16(deterministic: bool) -> None:
    """`deterministic` (asked for: off by default here) computes every linear layer, the experts and the head
    with rows padded to a whole tile, so a canvas's bits do not depend on its batch mates; without it, in
    bfloat16, some answer does."""
    bf16 = load_engine(FOLDER, device="cpu", dtype="bfloat16")
    assert bf16.params({}).deterministic is False  # the family's default
    params = bf16.params({"gen_length": 8, "seed": 0, "deterministic": deterministic})
    prompts = ["The jury said it", "To be, or not", "春眠不觉晓，", "def add(a, b):", "红豆生南国，", "Once upon a"]
    alone = [bf16.generate([p], params, batch_size=1)[0].text for p in prompts]
    together = [r.text for r in bf16.generate(prompts, params, batch_size=len(prompts))]
    assert (alone == together) is deterministic
