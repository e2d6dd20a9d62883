"""`celeris bench graphs`: every decode step the decoders run is one graph (torch.compile(fullgraph=True)
captures it, dynamo's eager backend: tracing only) and answers with it captured equal eager answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from celeris_cli.arch import invariant
from celeris_cli.arch.layers import DiffusionLM
from celeris_cli.cli.app import app
from celeris_cli.measure import graphs

DATA = Path(__file__).parent / "data"
runner = CliRunner()


def _graphs(*args: str) -> dict[str, Any]:
    r = runner.invoke(app, ["bench", "graphs", "--json", "--device", "cpu", "--gen-length", "8", *args])
    assert r.exit_code == 0, r.output
    report: dict[str, Any] = json.loads(r.stdout)
    return report


def test_the_ar_step_spec_round_cached_block_steps_and_canvas_step_are_each_one_graph() -> None:
    models = ("nemotron", "diffucoder", "sdar", "diffusion_gemma")
    names = ("ar-step", "spec-round", "dual-cache-step", "block-fast-step", "canvas-step")
    report = _graphs(*(a for m in models for a in ("-m", str(DATA / m))), *(a for s in names for a in ("--step", s)))
    assert set(report["steps"]) == set(names)
    for name in names:
        entry = report["steps"][name]
        assert entry["fullgraph"] is True and entry["identical"] is True, (name, entry)
        for row in entry["models"].values():
            assert row["calls"] > 0 and row["graphs"] >= 1 and "break" not in row, (name, row)


def test_a_host_read_inside_a_step_is_reported_as_a_break(monkeypatch: pytest.MonkeyPatch) -> None:
    real = DiffusionLM.step

    def reads_the_host(self: DiffusionLM, ids: torch.Tensor, *rest: Any) -> Any:
        if int(ids.max()) < 0:  # a host read: what a step must not hold
            raise AssertionError
        return real(self, ids, *rest)

    monkeypatch.setattr(DiffusionLM, "step", reads_the_host)
    report = _graphs("-m", str(DATA / "nemotron"), "--step", "ar-step")
    row = report["steps"]["ar-step"]["models"]["nemotron"]
    assert report["steps"]["ar-step"]["fullgraph"] is False and row["calls"] == 0
    assert row["break"], row
    assert report["steps"]["ar-step"]["identical"] is True  # the step ran eagerly from the break on


def test_answers_differing_under_capture_are_reported_as_not_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong(trace: graphs.Trace) -> Any:  # a backend whose graphs compute something else than eager
        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            trace.graphs += 1

            def run(*args: Any) -> Any:
                out = gm.forward(*args)
                flip = [o.flip(-1) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out]
                return type(out)(flip)

            return run

        return backend

    monkeypatch.setattr(graphs, "_counting", wrong)
    report = _graphs("-m", str(DATA / "nemotron"), "--step", "ar-step")
    assert report["steps"]["ar-step"]["fullgraph"] is True and report["steps"]["ar-step"]["identical"] is False


def _traced_code(on: bool, pinned: bool) -> tuple[str, int]:
    """The code dynamo traced of one batch-invariant linear layer over 3 rows, under the mode `on`; `pinned`:
    called inside `invariant.traced()` as a step is; and the graphs it made over two calls."""
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(invariant.linear, fullgraph=True, backend=backend)
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with invariant.enabled(on):
        for _ in range(2):
            if pinned:
                with invariant.traced():
                    out = fn(x, w)
            else:
                out = fn(x, w)
            assert torch.equal(out, invariant.linear(x, w))
    torch._dynamo.reset()
    return seen[0], len(seen)


def test_a_traced_step_computes_batch_invariantly_where_its_caller_asks_it() -> None:
    code_on, graphs_on = _traced_code(True, True)
    code_off, _ = _traced_code(False, True)
    assert "cat" in code_on and "cat" not in code_off  # the rows padded to ROW_TILE, as eager pads them
    assert graphs_on == 1  # the same mode: one graph reused
    unpinned, _ = _traced_code(True, False)
    assert "cat" not in unpinned  # outside `traced` a trace cannot read the caller's ContextVar


def test_the_command_refuses_an_unknown_step_and_a_missing_model_by_name(tmp_path: Path) -> None:
    r = runner.invoke(app, ["bench", "graphs", "--step", "warp-step"])
    assert r.exit_code == 2 and "--step 'warp-step'" in r.output
    r = runner.invoke(app, ["bench", "graphs", "-m", str(tmp_path / "nothing")])
    assert r.exit_code != 0 and "--model" in r.output
    r = runner.invoke(app, ["bench", "graphs", "-m", str(tmp_path)])
    assert r.exit_code != 0 and "no model folder" in r.output


def test_the_default_models_ar_step_and_its_bfloat16_head_are_one_graph(tmp_path: Path) -> None:
    out = tmp_path / "graphs.json"
    args = ["bench", "graphs", "--device", "cpu", "--gen-length", "8", "--step", "ar-step", "--out", str(out)]
    r = runner.invoke(app, args)  # the default: the embedded models, the default (bfloat16) one among them
    assert r.exit_code == 0, r.output
    row = json.loads(out.read_text())["steps"]["ar-step"]["models"]["celeris-spec"]
    assert row["fullgraph"] is True and row["identical"] is True and row["calls"] > 0, row
    assert any(line.split()[:4] == ["ar-step", "celeris-spec", "True", "True"] for line in r.stdout.splitlines())


def test_each_bucket_times_the_step_eager_and_captured() -> None:
    from celeris_cli.engine import load_engine

    engine = load_engine(str(DATA / "nemotron" / "nemotron_tiny"), device="cpu")
    cells = graphs.timed(engine, graphs.STEPS[0], 4, (1, 2), backend="eager")  # inductor's compile: minutes on CPU
    assert set(cells) == {"1", "2"}
    for cell in cells.values():
        assert cell["eager_ms"] > 0 and cell["captured_ms"] > 0 and "break" not in cell, cell


def test_exact_attention_masks_each_row_as_alone_eager_and_traced() -> None:
    torch.manual_seed(0)
    B, H, T, D = 2, 2, 5, 8
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    real = torch.tensor([[False, True, True, True, True], [True] * T])  # row 0 left-padded by one
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (real[:, None, None, :] & causal) | torch.eye(T, dtype=torch.bool)  # (B, 1, T, T)

    def alone(b: int, t: int) -> torch.Tensor:  # a softmax written here: the keys row b's query t may see
        keys = [j for j in range(T) if bool(mask[b, 0, t, j])]
        w = torch.softmax(torch.stack([(q[b, :, t] * k[b, :, j]).sum(-1) for j in keys], -1) / D**0.5, -1)
        return sum(w[:, i, None] * v[b, :, j] for i, j in enumerate(keys))  # type: ignore[return-value]

    eager = invariant.attention(q, k, v, mask, 0, False)
    for b, first in ((0, 1), (1, 0)):
        for t in range(first, T):
            torch.testing.assert_close(eager[b, :, t], alone(b, t), rtol=1e-5, atol=1e-5)
    invariant.plan(mask, 0, B, T, T)  # what `hidden` does before the step
    torch._dynamo.reset()
    traced = torch.compile(invariant.attention, fullgraph=True, backend="eager")(q, k, v, mask, 0, False)
    torch._dynamo.reset()
    assert torch.equal(traced, eager)
