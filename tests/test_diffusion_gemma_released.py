"""DiffusionGemma from a folder as transformers 5.23.0 itself writes it (tests/data/diffusion_gemma/README.md).

`saved_by_transformers/` is `DiffusionGemmaForBlockDiffusion.save_pretrained`'s own output, with the top-level
`eos_token_id` list the released config.json carries ([1, 106]) and `dtype` in each sub-config; its weights are
`diffusion_gemma_tiny/`'s, byte for byte. The oracle is transformers' own `generate` on that folder
(`diffusion_gemma_released_reference.json`): greedy-limit runs (t_min 0, t_max 1e-5, starting canvases pinned),
sampled runs with the released schedule (t 0.8 to 0.4) and with none (`t_min = t_max = None`: its generate then
leaves the logits unscaled, temperature 1 throughout), drawing from torch's CPU generator (`noise: torch`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.cli import app

DATA = Path(__file__).parent / "data" / "diffusion_gemma"
FOLDER = DATA / "saved_by_transformers"
REF = json.loads((DATA / "diffusion_gemma_released_reference.json").read_text(encoding="utf-8"))
CASES = [(kind, c) for kind in ("greedy", "sampled") for c in REF[kind]]
KEYS = {"max_new_tokens": "gen_length", "max_denoising_steps": "block_steps", "eos_token_id": "stop_token_ids"}
PAD = 0


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return load_engine(FOLDER, device="cpu", dtype="float32")


def request(case: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """A recorded run's settings under Celeris's names. t_max and t_min are the first and last temperatures;
    both None (no schedule in its generate) is a temperature of 1 from the first step to the last."""
    r = {KEYS.get(k, k): v for k, v in case["settings"].items() if k not in ("t_min", "t_max")}
    if "t_max" in case["settings"]:
        r["temperature"] = 1.0 if case["settings"]["t_max"] is None else case["settings"]["t_max"]
        r["temperature_final"] = 1.0 if case["settings"]["t_min"] is None else case["settings"]["t_min"]
    r |= {"block_length": case["block_length"], "seed": case["seed"]}
    if greedy:
        r["initial_canvases"] = case["initial_canvases"]
    else:
        r["noise"] = "torch"
    return r


def decoder_passes(nfe: int, case: dict[str, Any]) -> int:
    """Celeris counts the encoder's passes too: the prompt's, and one per canvas committed after it; as its
    generate, it decodes no canvas after the one that stops the answer."""
    return nfe - len(case["output_ids"]) // case["block_length"]


def test_the_folder_is_transformers_own_save_with_the_tiny_folders_weights() -> None:
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["eos_token_id"] == [1, 106] and config["transformers_version"] == "5.23.0"
    assert config["text_config"]["dtype"] == "float32"  # what save_pretrained adds to each sub-config
    generation = json.loads((FOLDER / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106, 50] and (generation["t_max"], generation["t_min"]) == (0.8, 0.4)
    tiny = DATA / "diffusion_gemma_tiny"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (FOLDER / name).read_bytes() == (tiny / name).read_bytes(), name


def test_the_records_cover_both_temperatures_and_each_kind_of_stop() -> None:
    """What the recorded runs must hold for the parity test below to mean what it says."""
    sampled = REF["sampled"]
    flat = [c for c in sampled if c["settings"].get("t_max", 0.8) is None]
    released = [c for c in sampled if "t_max" not in c["settings"]]
    assert len(flat) >= 3 and len(released) >= 2
    stops = {c["stop_id"] for _, c in CASES if c["stopped"]}
    assert {1, 106, 50} <= stops  # the config's top-level list (1, 106) and the generation config's alone (50)
    assert all("eos_token_id" not in c["settings"] for _, c in CASES)  # every stop is the folder's own


@pytest.mark.parametrize(("kind", "case"), CASES, ids=[f"{k}-{c['prompt']}-{c['seed']}" for k, c in CASES])
def test_every_recorded_run_is_token_exact(engine: Any, kind: str, case: dict[str, Any]) -> None:
    params = engine.params(request(case, kind == "greedy"))
    outs, nfe = engine.decode_ids([case["input_ids"]], params)
    n = len(case["output_ids"])  # its generate stops at the canvas holding a stop id; Celeris pads the rest
    assert outs[0][:n] == case["output_ids"], (case["prompt"], case["seed"], case["settings"])
    assert set(outs[0][n:]) <= {PAD}
    # the same number of decoder passes, so the adaptive stop ended every canvas at the same step
    valid = sum(t != PAD for t in case["output_ids"])
    assert valid / decoder_passes(nfe, case) == pytest.approx(case["tokens_per_forward"], rel=1e-6)


def test_a_constant_temperature_changes_the_answer(engine: Any) -> None:
    """Temperature 1 throughout is not the released schedule (rule 1): the same seed, another answer."""
    case = next(c for c in REF["sampled"] if c["settings"].get("t_max", 0.8) is None and not c["stopped"])
    flat = engine.params(request(case, False))
    scheduled = engine.params({**request(case, False), "temperature": 0.8, "temperature_final": 0.4})
    ids = [case["input_ids"]]
    assert engine.decode_ids(ids, flat)[0] != engine.decode_ids(ids, scheduled)[0]


def test_every_recorded_run_through_celeris_batch(engine: Any, tmp_path: Path) -> None:
    """The CLI's own path from the folder: `celeris batch` with each run's prompt text and settings."""
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    lines = [
        {"custom_id": str(i), "prompt": REF["prompts"][c["prompt"]], **request(c, kind == "greedy")}
        for i, (kind, c) in enumerate(CASES)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = ["batch", "-i", str(src), "-o", str(out), "--model", str(FOLDER), "--dtype", "float32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == len(CASES)
    for (_, case), got in zip(CASES, results):
        want = engine.tokenizer.continuation(case["input_ids"], case["answer_ids"])
        assert got["response"]["body"]["text"] == want, (case["prompt"], case["seed"], case["settings"])


def test_celeris_generate_with_equal_temperatures_is_its_generate_without_a_schedule(engine: Any) -> None:
    case = next(c for c in REF["sampled"] if c["settings"].get("t_max", 0.8) is None and c["stop_id"] == 106)
    args = ["generate", "--model", str(FOLDER), "--prompt", REF["prompts"][case["prompt"]], "--json", "--quiet"]
    args += ["--dtype", "float32", "--gen-length", str(case["settings"]["max_new_tokens"])]
    args += ["--temperature", "1", "--temperature-final", "1", "--noise", "torch", "--seed", str(case["seed"])]
    p = CliRunner().invoke(app, args)
    assert p.exit_code == 0, p.output
    assert json.loads(p.stdout)["text"] == engine.tokenizer.continuation(case["input_ids"], case["answer_ids"])


def test_inspect_on_the_folder_exits_0() -> None:
    p = CliRunner().invoke(app, ["inspect", str(FOLDER), "--json"])
    assert p.exit_code == 0, p.output
    info = json.loads(p.stdout)
    assert info["architecture"].startswith("diffusion_gemma") and info["canvas"].startswith("8 tokens")
    p = CliRunner().invoke(app, ["inspect", str(FOLDER), "--memory", "--dtype", "bfloat16"])
    assert p.exit_code == 0, p.output
