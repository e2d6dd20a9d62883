"""gpu-check's yardstick (`scripts/yardstick.py`) decodes the very network it stands beside: its plain static-cache
loop, written apart from the project, gives the project's logits for a block step over an empty cache and for
a run of AR steps (against the project's forward under a causal mask), in float32 on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from celeris_cli import load_engine

REPO = Path(__file__).parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from yardstick import Loop, measure  # noqa: E402


def _loop_and_model():  # type: ignore[no-untyped-def]
    engine = load_engine(REPO / "tests" / "data" / "llada_hf", device="cpu", dtype="float32")
    cfg = engine.model.cfg
    return Loop(engine.model.state_dict(), cfg.n_heads, cfg.rope_theta, cfg.rms_norm_eps), engine.model


def test_a_block_step_over_an_empty_cache_is_the_projects_forward() -> None:
    loop, model = _loop_and_model()
    ids = torch.randint(10, 380, (2, 6), generator=torch.Generator().manual_seed(0))
    step, io = loop.stepper(2, 6, 16)
    io["tokens"].copy_(ids)
    with torch.no_grad():
        step()
        want = model(ids)
    got = io["logits"][..., : want.shape[-1]]
    assert (got - want).abs().max().item() < 1e-4
    assert int(io["start"]) == 0  # a block step is repeated in place


def test_ar_steps_over_the_cache_are_the_projects_forward_under_a_causal_mask() -> None:
    loop, model = _loop_and_model()
    ids = torch.randint(10, 380, (2, 7), generator=torch.Generator().manual_seed(1))
    step, io = loop.stepper(2, 1, 16)
    got = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            io["tokens"].copy_(ids[:, t : t + 1])
            step()
            got.append(io["logits"].clone())
        causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, 7, 7)
        h, _ = model.hidden(ids, key_mask=causal)
        want = model.head(h)
    got_t = torch.cat(got, 1)[..., : want.shape[-1]]
    assert (got_t - want).abs().max().item() < 1e-4 and int(io["start"]) == 7


def test_measure_reports_eager_figures_and_no_graph_on_a_cpu() -> None:
    loop, _ = _loop_and_model()
    row = measure(loop, 2, 1, 16, steps=2)
    assert row["batch"] == 2 and row["q"] == 1 and row["eager_ms"] > 0 and row["eager_positions_per_s"] > 0
    assert row["graph_ms"] is None and "graph_error" not in row
