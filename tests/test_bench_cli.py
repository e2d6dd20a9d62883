"""`celeris bench`'s subcommands: each runs its own measurement with the options it was given and writes its
report through the one writer (`--out` as JSON, `--json` or a table); the old one-command flags are refused
by name. The measurements that write gigabytes or start Ray are replaced by recorders of what they were
asked; the others run for real on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app

runner = CliRunner()
SMALL = json.dumps({"gen_length": 8, "block_length": 8, "denoise_steps": 4})
SUBCOMMANDS = [
    "memory",
    "loading",
    "ray",
    "scaling",
    "workload",
    "invariance",
    "invariance-cost",
    "sweep",
    "structured",
    "graphs",
]


def _run(args: list[str]) -> Any:
    r = runner.invoke(app, ["bench", *args], terminal_width=200)
    assert r.exit_code == 0, r.output
    return r


def test_bench_help_lists_every_subcommand_and_each_has_its_own_help() -> None:
    out = _run(["--help"]).stdout
    assert "Commands:" in out and all(f"  {name} " in out for name in SUBCOMMANDS)
    assert "--memory" not in out and "--sweep" not in out and "--scaling-gen" not in out
    for name in SUBCOMMANDS:
        shown = _run([name, "--help"]).stdout
        assert f"Usage: root bench {name}" in shown and "<bool>" not in shown


def test_memory_measures_with_its_threads_and_writes_a_table_json_and_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked: list[int] = []
    row = {"model": "celeris-block", "strategy": "default", "dtype": "float32", "batch": 16, "weights_mib": 1,
           "kv_cache_mib": 2, "activations_mib": 3, "logits_mib": 4, "predicted_mib": 10, "measured_mib": 11,
           "measured_glibc_default_mib": 12, "predicted_over_measured": 0.91}  # fmt: skip

    def check_default(threads: int = 2) -> dict[str, Any]:
        asked.append(threads)
        return {"hardware": {"threads": threads}, "memory": [row]}

    monkeypatch.setattr("celeris_cli.measure.memory.check_default", check_default)
    table = _run(["memory", "--out", str(tmp_path / "m.json")]).stdout
    assert "memory planner vs measured" in table and "0.91" in table
    assert json.loads((tmp_path / "m.json").read_text())["memory"] == [row]
    assert json.loads(_run(["memory", "--threads", "3", "--json"]).stdout)["hardware"] == {"threads": 3}
    assert asked == [2, 3]


def test_loading_measures_the_size_asked_and_prints_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[float] = []

    def measure_loading(size_gb: float) -> list[dict[str, Any]]:
        asked.append(size_gb)
        return [{"on_disk_gb": size_gb, "dtype": "bfloat16"}]

    monkeypatch.setattr("celeris_cli.measure.loading.measure_loading", measure_loading)
    out = _run(["loading", "1.5", "--out", str(tmp_path / "l.json")]).stdout
    assert (
        json.loads(out)["loading"] == [{"on_disk_gb": 1.5, "dtype": "bfloat16"}]
        and "cpu" in json.loads(out)["hardware"]
    )
    assert json.loads((tmp_path / "l.json").read_text()) == json.loads(out)
    assert asked == [1.5]
    r = runner.invoke(app, ["bench", "loading", "0"])
    assert r.exit_code == 2 and "GB must be more than 0" in r.output and asked == [1.5]


def test_ray_runs_batch_with_the_prompts_model_and_batch_size_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked: list[tuple[Any, ...]] = []

    def bench_batch(n_prompts: int, batch_size: int, work: Path, engine_options: dict[str, Any]) -> dict[str, Any]:
        asked.append((n_prompts, batch_size, engine_options))
        return {"prompts": n_prompts, "runs": {}}

    monkeypatch.setattr("celeris_cli.measure.bench.bench_batch", bench_batch)
    args = ["ray", "12", "--model", "celeris-tiny", "--batch-size", "4", "--device", "cpu", "--dtype", "float32"]
    out = _run([*args, "--out", str(tmp_path / "r.json")]).stdout
    assert json.loads(out) == {"prompts": 12, "runs": {}} == json.loads((tmp_path / "r.json").read_text())
    assert asked == [(12, 4, {"model": "celeris-tiny", "device": "cpu", "dtype": "float32"})]


def test_scaling_measures_its_cells_and_rejects_a_bad_list(tiny_model: Path, tmp_path: Path) -> None:
    args = ["scaling", "--model", str(tiny_model), "--gen-lengths", "8", "--batch-sizes", "2", "--block-length", "8"]
    out = _run([*args, "--device", "cpu", "--out", str(tmp_path / "s.json")]).stdout
    assert "x ar-limit" in out and json.loads((tmp_path / "s.json").read_text())["cells"][0]["batch"] == 2
    report = json.loads(_run([*args[:-4], "--batch-sizes", "1", "--device", "cpu", "--json"]).stdout)
    assert [(c["gen_length"], c["batch"]) for c in report["cells"]] == [(8, 1)]
    r = runner.invoke(app, ["bench", *args[:6], "2,x"])
    assert r.exit_code == 2 and "--batch-sizes must be comma-separated integers" in r.output


def test_workload_runs_static_and_continuous_and_writes_its_report(tiny_model: Path, tmp_path: Path) -> None:
    args = ["workload", "mixed", "--model", str(tiny_model), "--prompts", "4", "--batch-size", "2", "--device", "cpu"]
    report = json.loads(_run([*args, "--json", "--out", str(tmp_path / "w.json")]).stdout)
    assert report == json.loads((tmp_path / "w.json").read_text())
    assert report["answers"] == 4 and set(report["scheduling"]) == {"static", "continuous"}
    assert "occupancy" in _run(args[:1] + args[2:]).stdout  # the workload's name may be left out: a table
    r = runner.invoke(app, ["bench", "workload", "steady", "--model", str(tiny_model)])
    assert r.exit_code == 2 and "'steady' is not one of 'mixed'" in r.output


def test_invariance_decodes_n_prompts_alone_and_batched(tiny_model: Path, tmp_path: Path) -> None:
    args = ["invariance", "3", "--model", str(tiny_model), "--batch-size", "2", "--set", SMALL, "--device", "cpu"]
    out = _run([*args, "--dtype", "float32", "--out", str(tmp_path / "i.json")]).stdout
    report = json.loads(out)
    assert report == json.loads((tmp_path / "i.json").read_text())
    assert report["prompts"] == 3 and report["batch_size"] == 2 and report["identical_rows"] == 1.0
    assert {k: report["settings"][k] for k in json.loads(SMALL)} == json.loads(SMALL)  # --set applied


def test_invariance_cost_runs_each_batch_size_on_and_off(tiny_model: Path, tmp_path: Path) -> None:
    args = ["invariance-cost", "1,2", "--model", str(tiny_model), "--prompts", "2", "--set", SMALL, "--device", "cpu"]
    report = json.loads(_run([*args, "--out", str(tmp_path / "c.json")]).stdout)
    assert report == json.loads((tmp_path / "c.json").read_text())
    assert [row["batch_size"] for row in report["rows"]] == [1, 2] and report["prompts"] == 2
    r = runner.invoke(app, ["bench", "invariance-cost", "1,0"])
    assert r.exit_code == 2 and "the batch sizes must be positive integers" in r.output


def test_sweep_gives_a_row_per_step_count_and_writes_its_report(tiny_model: Path, tmp_path: Path) -> None:
    args = ["sweep", "2,4", "--model", str(tiny_model), "--prompts", "2", "--gen-length", "8", "--device", "cpu"]
    out = _run([*args, "--out", str(tmp_path / "s.json")]).stdout
    assert "denoising steps vs quality" in out
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [row["denoise_steps"] for row in rows] == [2, 4]  # no model beside a folder
    versus = json.loads(_run([*args, "--versus", str(tiny_model), "--json"]).stdout)["rows"]
    assert [row["denoise_steps"] for row in versus] == [2, 4, 2, 4]
    r = runner.invoke(app, ["bench", "sweep", "a,b"])
    assert r.exit_code == 2 and "the step counts must be comma-separated integers" in r.output


@pytest.mark.parametrize(
    ("argv", "flag", "new"),
    [
        (["--memory"], "--memory", "memory"),
        (["--loading", "2"], "--loading", "loading GB"),
        (["--ray-compare", "8"], "--ray-compare", "ray N"),
        (["--scaling"], "--scaling", "scaling"),
        (["scaling", "--scaling-gen=8"], "--scaling-gen", "scaling --gen-lengths"),
        (["--scaling-batch", "2"], "--scaling-batch", "scaling --batch-sizes"),
        (["--workload", "mixed"], "--workload", "workload mixed"),
        (["--invariance", "4"], "--invariance", "invariance N"),
        (["--invariance-cost", "1,16"], "--invariance-cost", "invariance-cost B,B,..."),
        (["--prompts", "2", "--sweep", "2,4"], "--sweep", "sweep N,N,..."),
    ],
)
def test_an_old_only_measure_flag_is_refused_naming_its_subcommand(argv: list[str], flag: str, new: str) -> None:
    r = runner.invoke(app, ["bench", *argv])
    assert r.exit_code == 2 and r.stderr.splitlines() == [f"Error: {flag} is now `celeris bench {new}`"]


def test_main_bench_options_before_a_subcommand_are_refused_not_ignored(tiny_model: Path) -> None:
    r = runner.invoke(app, ["bench", "--model", str(tiny_model), "--threads", "1", "invariance", "2"])
    assert r.exit_code == 2 and "--model, --threads before `invariance` would be ignored" in r.stderr
