"""`--cuda-graphs auto|on|off`: each decode step run through its `torch.compile` (on CUDA, CUDA graphs), on every
command that loads a model; `on` without a CUDA device is a usage error that names the option. On this CPU the
capture path runs with dynamo's eager backend (tracing only): the steps go through the compiled function and
the answers stay the eager ones."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli.arch import capture
from celeris_cli.arch.layers import DiffusionLM
from celeris_cli.cli.app import app
from celeris_cli.engine import load_engine
from celeris_cli.errors import TooLarge, UsageError

DATA = Path(__file__).parent / "data"
runner = CliRunner()
PROMPTS = ["The jury said it", "红豆生南国，"]


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "hi"],
        ["batch", "-i", "in.jsonl", "-o", "out.jsonl"],
        ["bench", "--prompts", "1"],
    ],
    ids=["generate", "batch", "bench"],
)
def test_cuda_graphs_on_with_a_cpu_device_exits_2_naming_the_option(command: list[str], tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    args = [a if not a.endswith(".jsonl") else str(tmp_path / a) for a in command]
    r = runner.invoke(
        app, [*args, "--device", "cpu", "--cuda-graphs", "on", "-m", str(DATA / "nemotron" / "nemotron_tiny")]
    )
    assert r.exit_code == 2, r.output
    assert "--cuda-graphs" in r.output, r.output
    assert not (tmp_path / "out.jsonl").exists()


def test_serve_with_cuda_graphs_on_and_a_cpu_device_is_refused_before_it_serves() -> None:
    from celeris_cli.cli.app import DeviceOpt, GraphsOpt
    from celeris_cli.cli.serve import _build

    with pytest.raises(UsageError, match="--cuda-graphs"):  # `_build` runs before uvicorn: nothing listens
        _build(str(DATA / "nemotron" / "nemotron_tiny"), None, DeviceOpt.cpu, None, None, None, 1, GraphsOpt.on)


def test_an_out_of_memory_error_inside_a_captured_step_goes_to_the_back_off() -> None:
    engine = load_engine(DATA / "nemotron" / "nemotron_tiny", device="cpu", dtype="float32")

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("fake")

    captured = engine.capture_steps(backend="eager", mode=None)
    captured.compiled = fails
    try:
        with pytest.raises(TooLarge, match="out of memory alone"):  # the back-off halved it down to one row
            _answers(engine, {"strategy": "ar"})
        assert captured.error is None  # still capturing: a smaller batch may fit
    finally:
        captured.remove()


def test_an_unknown_cuda_graphs_value_is_refused_by_name() -> None:
    r = runner.invoke(app, ["generate", "--prompt", "hi", "--cuda-graphs", "always"])
    assert r.exit_code == 2 and "--cuda-graphs" in r.output, r.output


def test_the_queue_config_takes_cuda_graphs_and_refuses_on_with_a_cpu_device(tmp_path: Path) -> None:
    from celeris_cli.errors import ConfigError
    from celeris_cli.spool.config import load_config

    path = tmp_path / "batch.yaml"
    path.write_text("device: auto\ncuda_graphs: off\n")  # YAML's bare off is false: taken as "off"
    assert load_config(path).cuda_graphs == "off"
    path.write_text("device: cuda\ncuda_graphs: on\n")
    assert load_config(path).cuda_graphs == "on"
    path.write_text("device: cpu\ncuda_graphs: on\n")
    with pytest.raises(ConfigError, match="cuda_graphs"):
        load_config(path)
    path.write_text("cuda_graphs: sometimes\n")
    with pytest.raises(ConfigError, match="cuda_graphs"):
        load_config(path)


def test_auto_is_off_until_measured_and_on_needs_cuda() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert capture.resolve("auto", cpu) is False and capture.resolve("auto", cuda) is False
    assert capture.resolve("on", cuda) is True and capture.resolve("off", cuda) is False
    with pytest.raises(UsageError, match="--cuda-graphs"):
        capture.resolve("on", cpu)
    assert load_engine(DATA / "nemotron" / "nemotron_tiny", device="cpu", cuda_graphs="auto").capture is None


def _answers(engine: Any, settings: dict[str, Any]) -> list[tuple[str, int]]:
    params = engine.params({**settings, "gen_length": 8, "seed": 3})
    return [(r.text, r.nfe) for r in engine.generate(PROMPTS, params, batch_size=2)]


@pytest.mark.parametrize(
    ("model", "settings", "dtype"),
    [
        ("nemotron", {"strategy": "ar"}, "float32"),
        ("nemotron", {}, "float32"),  # the model's default strategy
        # the canvas step; its experts' grouped matmul traces in bfloat16 only (torch 2.13's meta kernel)
        ("diffusion_gemma", {}, "bfloat16"),
    ],
    ids=["ar-step", "default", "canvas"],  # one capture for every step: bench graphs traces each (test_graphs)
)
def test_captured_steps_run_through_the_compiled_step_and_answer_as_eager(
    model: str, settings: dict[str, Any], dtype: str
) -> None:
    engine = load_engine(DATA / model / f"{model}_tiny", device="cpu", dtype=dtype)
    eager = _answers(engine, settings)
    graphs = 0

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    captured = engine.capture_steps(backend=counting, mode=None)
    try:
        assert _answers(engine, settings) == eager
        assert captured.error is None and captured.calls > 0 and graphs >= 1, (captured.error, captured.calls)
    finally:
        captured.remove()
    assert capture.method_of(engine.model) not in engine.model.__dict__  # the model's own method again


def test_a_step_that_cannot_be_captured_is_said_and_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = load_engine(DATA / "nemotron" / "nemotron_tiny", device="cpu", dtype="float32")
    eager = _answers(engine, {"strategy": "ar"})
    real = DiffusionLM.step

    def reads_the_host(self: DiffusionLM, ids: torch.Tensor, *rest: Any) -> Any:
        if int(ids.max()) < 0:  # a host read: a graph break under fullgraph
            raise AssertionError
        return real(self, ids, *rest)

    monkeypatch.setattr(DiffusionLM, "step", reads_the_host)
    captured = engine.capture_steps(backend="eager", mode=None)
    with caplog.at_level(logging.WARNING, logger="celeris_cli.arch.capture"):
        assert _answers(engine, {"strategy": "ar"}) == eager
    assert captured.error is not None and captured.calls == 0
    assert any("--cuda-graphs" in r.getMessage() for r in caplog.records)
