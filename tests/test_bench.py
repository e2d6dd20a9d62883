"""`celeris bench` on the tiny model: every figure is present and consistent (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from celeris_cli.cli import app
from celeris_cli.engine import Engine
from celeris_cli.measure.bench import MODES, agreement, bench, bench_queue
from celeris_cli.measure.evaluate import EvalSet
from celeris_cli.measure.invariance import batch_invariance


def test_bench_reports_every_mode_with_speed_and_quality_figures(eos_prone: Engine) -> None:
    report = bench(eos_prone, n_prompts=6, batch_size=1, gen_length=16, block_length=4)
    assert set(report["modes"]) == set(MODES)
    modes = report["modes"]
    assert modes["reference"]["nfe"] == 6 * 16  # six batches of one, one forward per step, steps = gen_length
    # the modes really run what their names say: early exit saves forwards, and changes no answer
    assert modes["threshold+exit"]["nfe"] < modes["threshold"]["nfe"]
    assert modes["threshold+exit"]["output_tokens"] == modes["threshold"]["output_tokens"]
    for m in modes.values():
        assert m["output_tokens"] > 0 and m["wall_s"] > 0 and m["tokens_per_s"] > 0
        assert 0 <= m["structure_rate"] <= 1 and 0 <= m["distinct_2"] <= 1
        assert m["of_raw_forward"] > 0 and m["peak_mem_mb"] >= 0 and m["speedup"] > 0
    for key in ("cpu", "cores", "torch", "threads"):
        assert key in report["hardware"]
    assert report["gen_length"] == 16 and report["block_length"] == 4 and report["denoise_steps"] == 16
    assert set(report["cache_agreement_temperature_0"]) == {"prefix", "dual"}
    # positions computed: the reference runs every step over the whole canvas (prompt + 16), batches of one
    canvas = sum(len(eos_prone.encode_prompt(r["prompt"])) + 16 for r in EvalSet.load().poems[:6])
    ref = modes["reference"]
    assert ref["positions_per_output_token"] == round(16 * canvas / ref["output_tokens"], 1)
    assert modes["dual-cache"]["positions_per_output_token"] < ref["positions_per_output_token"]
    ar = report["autoregressive_limit"]  # one position per row per forward after the prompt's forward
    P = report["prompt_tokens"]["max"]
    assert ar["nfe"] == 6 * 16 and ar["positions_per_output_token"] == round((P + 15) / 16, 3)
    assert ar["output_tokens"] == 6 * 16 and ar["tokens_per_s"] > 0
    for m in modes.values():
        assert m["of_ar_limit"] == round(m["tokens_per_s"] / ar["tokens_per_s"], 4)


def test_batch_invariance_is_exact_in_float32(engine: Engine) -> None:
    r = batch_invariance(engine, 8, 4, {"gen_length": 16, "block_length": 8, "denoise_steps": 8, "temperature": 1.0})
    assert r["prompts"] == 8 and r["prompt_tokens"]["min"] < r["prompt_tokens"]["max"]
    assert r["identical_rows"] == 1.0 and r["dtype"] == "float32"


def test_agreement_counts_identical_rows_and_characters() -> None:
    assert agreement(["abc", "xy"], ["abc", "xz"]) == {"identical_rows": 0.5, "char_agreement": 0.8}


def test_queue_benchmark_batches_one_prompt_files(engine: Engine, tmp_path: Path) -> None:
    params = engine.params({"gen_length": 8, "block_length": 8, "denoise_steps": 4})
    q = bench_queue(engine, 20, 8, params, tmp_path)
    assert q["files"] == 20 and sum(q["batch_sizes"]) == 20 and max(q["batch_sizes"]) == 8
    assert len(list((tmp_path / "batch_outputs").glob("*.results.jsonl"))) == 20


def test_bench_cli_json_and_unknown_mode(tiny_model: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    args = [
        "bench",
        "--model",
        str(tiny_model),
        "--prompts",
        "2",
        "--batch-size",
        "2",
        "--gen-length",
        "8",
        "--block-length",
        "8",
        "--modes",
        "reference,dual-cache",
        "--no-agreement",
        "--device",
        "cpu",
    ]
    r = runner.invoke(app, [*args, "--json", "--out", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.stdout)["modes"]) == {"reference", "dual-cache"}
    assert json.loads((tmp_path / "b.json").read_text())["batch_size"] == 2
    r = runner.invoke(app, [a if a != "reference,dual-cache" else "warp" for a in args])
    assert r.exit_code != 0 and "unknown mode 'warp'" in r.output


def test_bench_block_length_defaults_to_the_models(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"block_length": 4}), encoding="utf-8")
    args = ["bench", "--model", str(folder), "--prompts", "2", "--batch-size", "2", "--gen-length", "8"]
    r = CliRunner().invoke(app, [*args, "--modes", "dual-cache", "--no-agreement", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["block_length"] == 4
    r = CliRunner().invoke(app, [*args, "--block-length", "8", "--modes", "dual-cache", "--no-agreement", "--json"])
    assert json.loads(r.stdout)["block_length"] == 8


def test_scaling_measures_each_cell_that_fits_as_one_batch(eos_prone: Engine) -> None:
    from celeris_cli.measure.scaling import scaling

    report = scaling(eos_prone, gen_lengths=(8, 300), batches=(1, 3), block_length=4)
    cells = {(c["gen_length"], c["batch"]): c for c in report["cells"]}
    assert set(cells) == {(8, 1), (8, 3), (300, 1), (300, 3)}
    assert "context 256" in cells[(300, 1)]["skipped"] and "modes" not in cells[(300, 3)]
    assert report["yardstick"] == "ar-limit" and report["modes"] == ["reference", *report["modes"][1:-1], "ar-limit"]
    for batch in (1, 3):
        modes = cells[(8, batch)]["modes"]
        ref, fast, limit = modes["reference"], modes["dual-cache"], modes["ar-limit"]
        assert ref["nfe"] == 8  # one batch, one forward per step, steps = gen_length
        assert 0 < ref["output_tokens"] <= 8 * batch and fast["output_tokens"] <= 8 * batch
        assert ref["peak_mem_mb"] >= 0 and fast["tokens_per_s"] > 0 and limit["output_tokens"] == 8 * batch
        assert fast["x_ar"] == round(fast["tokens_per_s"] / limit["tokens_per_s"], 2) and limit["x_ar"] == 1.0
    assert all(report["same_answers_in_every_cell"].values()) and report["the_ar_modes_answers"] == {}


def test_bench_versus_another_model_on_the_same_prompts(tiny_model: Path, tiny_tokenizer: Path, tmp_path: Path) -> None:
    """A block-diffusion model benched against a bidirectional one: its own block modes, the other's
    reference and default mode on the same prompts, every row also as a multiple of the other's reference."""
    from .conftest import make_model

    block = make_model(tmp_path / "block", tiny_tokenizer, block_causal=True)
    args = ["bench", "--model", str(block), "--prompts", "3", "--batch-size", "2", "--gen-length", "8"]
    r = CliRunner().invoke(app, [*args, "--versus", str(tiny_model), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["architecture"] == "llada_block" and set(report["modes"]) == {"block", "block-fast"}
    assert report["block_length"] == 8 and report["denoise_steps"] == 8  # the architecture's defaults
    versus = report["versus"]
    assert versus["model"] == str(tiny_model) and versus["baseline"] == "reference"
    assert set(versus["modes"]) == {"reference", "dual-cache"}
    assert versus["modes"]["reference"]["nfe"] == 2 * 8  # its own defaults: steps = gen_length, two batches
    ref = versus["modes"]["reference"]["tokens_per_s"]
    for m in [*report["modes"].values(), *versus["modes"].values()]:
        assert m["x_versus_baseline"] == round(m["tokens_per_s"] / ref, 2)
    r = CliRunner().invoke(app, [*args, "--versus", str(tmp_path / "nowhere"), "--device", "cpu"])
    assert r.exit_code != 0 and "nowhere" in r.output


def test_an_embedded_model_is_named_by_its_folder_name(tmp_path: Path, monkeypatch: object) -> None:
    from celeris_cli.engine import default_model_dir, embedded_models, model_dir

    assert model_dir("celeris-spec") == default_model_dir() == embedded_models()["celeris-spec"]
    assert model_dir("celeris-block") == embedded_models()["celeris-block"] != default_model_dir()
    assert model_dir("celeris-tiny") == embedded_models()["celeris-tiny"] != default_model_dir()
    assert model_dir(None) == default_model_dir()
    assert model_dir(str(tmp_path)) == tmp_path  # a folder that exists is a folder


def test_the_default_mode_is_the_row_with_the_models_own_cache(tiny_model: Path, tmp_path: Path) -> None:
    """A model whose generation config says `cache: prefix` and a suffix window is benched with prefix-cache
    as its default mode (the greedy comparison runs it), the window in every row's settings,
    and the table marks that row."""
    import shutil

    from celeris_cli import load_engine

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    config = {"cache": "prefix", "suffix_window": 4}
    (folder / "generation_config.json").write_text(json.dumps(config), encoding="utf-8")
    engine = load_engine(folder, device="cpu", dtype="float32")
    canvas = {"n_prompts": 2, "batch_size": 2, "gen_length": 16, "block_length": 4}
    report = bench(engine, **canvas, modes=["reference", "prefix-cache"])  # type: ignore[arg-type]
    assert report["default_mode"] == "prefix-cache"
    assert set(report["greedy_agreement_with_reference"]) == {"prefix-cache"}
    assert report["settings"]["suffix_window"] == 4
    dual = bench(engine, **canvas, modes=["dual-cache"], settings={"cache": "dual"}, cache_agreement=False)  # type: ignore[arg-type]
    assert dual["default_mode"] == "dual-cache"  # --set's cache over the model's
    modes = "reference,prefix-cache,dual-cache"
    r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--prompts", "2", "--batch-size", "2",
                                 "--gen-length", "16", "--block-length", "4", "--modes", modes,
                                 "--no-agreement", "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "prefix-cache (default)" in r.output and "dual-cache (default)" not in r.output
    assert "suffix window 4" in r.output
    plain = load_engine(tiny_model, device="cpu", dtype="float32")
    tiny = bench(plain, **canvas, modes=["reference"], cache_agreement=False)  # type: ignore[arg-type]
    assert tiny["default_mode"] == "dual-cache"  # the built-in default cache


def test_the_step_sweep_gives_each_model_a_row_per_total_of_steps(tiny_model: Path) -> None:
    """More denoising steps in total: more forwards (early exit off), on the model itself and on the one
    beside it; every row carries the figures the seeds' experiment compares."""
    from celeris_cli import load_engine
    from celeris_cli.measure.sweep import step_sweep

    engine = load_engine(tiny_model, device="cpu", dtype="float32")
    settings = {"early_exit": False, "threshold": 1.0}
    report = step_sweep([engine, engine], [2, 4, 8], n_prompts=2, batch_size=2, gen_length=8, settings=settings)
    rows = report["rows"]
    assert [r["denoise_steps"] for r in rows] == [2, 4, 8] * 2 and {r["gen_length"] for r in rows} == {8}
    first = [r["nfe"] for r in rows[:3]]
    assert first == sorted(first) and first[0] < first[-1]
    for r in rows:
        for key in ("tokens_per_s", "wall_s", "peak_mem_mb", "structure_rate", "distinct_2"):
            assert key in r
