"""`celeris bench scaling` on a model with an AR mode (Nemotron-Labs-Diffusion's tiny checkpoint): every mode
per batch size against the real AR decode, with tokens per forward, positions per output token and draft
acceptance; the exact modes' answers are the AR mode's and the same in every cell; `--plot` draws tokens/s
against the batch size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.cli import app
from celeris_cli.measure.scaling import plot, scaling

FOLDER = Path(__file__).parent / "data" / "nemotron" / "nemotron_tiny"


@pytest.fixture(scope="module")
def report() -> dict:
    engine = load_engine(FOLDER, device="cpu", dtype="float32")
    return scaling(engine, gen_lengths=(12,), batches=(1, 4), settings={"temperature": 0.0}, steps=4)


def test_every_mode_is_measured_against_the_real_ar_decode(report: dict) -> None:
    assert report["yardstick"] == "ar" and report["default_mode"] == "spec"
    assert report["modes"] == ["ar", "nemotron", "nemotron-spec", "spec", "spec-always"]
    for cell in report["cells"]:
        modes = cell["modes"]
        ar = modes["ar"]["tokens_per_s"]
        for m in modes.values():
            assert m["tokens_per_forward"] > 0 and m["x_ar"] == round(m["tokens_per_s"] / ar, 2)
        assert "draft_acceptance" in modes["spec-always"] and "draft_acceptance" not in modes["ar"]
        assert 0 <= modes["spec-always"]["draft_acceptance"] <= 1
        # drafting every round computes more positions per token than stepping (its drafts rarely agree)
        assert modes["spec-always"]["positions_per_output_token"] > modes["ar"]["positions_per_output_token"]
    assert report["the_ar_modes_answers"] == {"nemotron-spec": True, "spec": True, "spec-always": True}
    assert all(report["same_answers_in_every_cell"].values())


def test_the_plot_is_an_svg_with_a_line_per_mode(report: dict, tmp_path: Path) -> None:
    plot(report, tmp_path / "s.svg")
    svg = (tmp_path / "s.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 1 + len(report["modes"])  # the axes, the modes
    assert "spec (default)" in svg and "gen_length 12" in svg


def test_the_command_writes_its_plot_and_refuses_another_format(tmp_path: Path) -> None:
    args = ["bench", "scaling", "--model", str(FOLDER), "--gen-lengths", "8", "--batch-sizes", "2", "--device", "cpu"]
    r = CliRunner().invoke(app, [*args, "--plot", str(tmp_path / "p.svg"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["cells"][0]["batch"] == 2 and (tmp_path / "p.svg").read_text().startswith("<svg")
    r = CliRunner().invoke(app, [*args, "--plot", str(tmp_path / "p.gif")])
    assert r.exit_code != 0 and "give a .svg or .png file" in r.output and "Traceback" not in r.output


def test_repeats_keep_each_modes_median_run_the_order_alternating(monkeypatch: pytest.MonkeyPatch) -> None:
    from celeris_cli.measure import scaling as module

    engine = load_engine(FOLDER, device="cpu", dtype="float32")
    real, order, speeds = module.run_mode, [], iter([30.0, 20.0, 10.0])

    def run(engine, prompts, params, batch):  # type: ignore[no-untyped-def]
        r = real(engine, prompts, params, batch)
        if batch == 2:  # the cell's runs (the untimed warm-up decodes four openings)
            order.append((params.strategy, params.drafting if params.strategy == "spec" else None))
            if params.strategy == "ar":
                r["tokens_per_s"] = next(speeds)
        return r

    monkeypatch.setattr(module, "run_mode", run)
    report = module.scaling(engine, gen_lengths=(8,), batches=(2,), settings={"temperature": 0.0}, steps=4, repeats=3)
    assert (
        report["repeats"] == 3 and report["cells"][0]["modes"]["ar"]["tokens_per_s"] == 20.0
    )  # of 30, 20, 10: neither the first nor the last
    n = len(report["modes"])
    assert len(order) == 3 * n and order[:n] == order[n : 2 * n][::-1] == order[2 * n :]
    with pytest.raises(Exception, match="--repeats"):
        module.scaling(engine, gen_lengths=(8,), batches=(2,), repeats=0)


def test_a_png_plot_without_matplotlib_is_refused_before_anything_is_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import celeris_cli.engine

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if it were not installed

    def measured(*args: object, **kw: object) -> None:
        raise AssertionError("the model was loaded: the measurement began")

    monkeypatch.setattr(celeris_cli.engine, "load_engine", measured)
    args = ["bench", "scaling", "--model", str(FOLDER), "--gen-lengths", "8", "--batch-sizes", "2", "--device", "cpu"]
    r = CliRunner().invoke(app, [*args, "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and "needs matplotlib" in r.output and "[plot]" in r.output, r.output
    assert not (tmp_path / "p.png").exists()
