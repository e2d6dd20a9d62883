"""The strategy table (`celeris_cli/strategy.py`) is the one place strategies are named: every layer reads
its entry, and changing an entry changes what that layer does."""

from __future__ import annotations

import ast
from dataclasses import fields, replace
from pathlib import Path

import pytest

from celeris_cli.arch.registry import ARCHITECTURES
from celeris_cli.decode.strategies import DECODERS, plan_for
from celeris_cli.errors import UsageError
from celeris_cli.params import KNOBS, GenerationParams
from celeris_cli.strategy import STRATEGIES

PACKAGE = Path(__file__).resolve().parents[1] / "celeris_cli"
# where a strategy's name may be written: the table, the architectures' lists of what runs on them, the
# benchmark's modes (named after the strategy they run) and the user-facing help that names them
ALLOWED = {"strategy.py", "arch/registry.py", "measure/bench.py", "params.py", "cli/bench.py", "cli/bench_only.py"}


def test_every_layer_reads_the_one_table() -> None:
    assert KNOBS["strategy"].choices == tuple(STRATEGIES)
    for arch in ARCHITECTURES.values():
        assert set(arch.strategies) <= set(STRATEGIES), arch.name
    for name, spec in STRATEGIES.items():
        arch = next(a for a in ARCHITECTURES.values() if name in a.strategies)  # one it runs on: its defaults
        params = GenerationParams.from_mapping({"strategy": name}, GenerationParams.defaults_from(arch.layer()))
        plan = plan_for(params)  # the decoder receives exactly its strategy's parts
        assert {f.name for f in fields(plan)} == set(spec.parts), name
        assert spec.decoder in DECODERS, name


def test_no_module_compares_a_strategy_name_of_its_own() -> None:
    """`params.strategy == "..."` or `in (...)` outside the table: a rule that belongs in an entry."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and ast.unparse(node.left).endswith("strategy"):
                names = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in STRATEGIES]
                if names:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_an_entrys_rules_are_what_the_layers_do(monkeypatch: pytest.MonkeyPatch) -> None:
    dream = GenerationParams.from_mapping({"strategy": "dream", "gen_length": 8})
    assert dream.with_(denoise_steps=20).denoise_steps == 20  # uncapped: more steps than tokens
    monkeypatch.setitem(STRATEGIES, "dream", replace(STRATEGIES["dream"], uncapped=False))
    with pytest.raises(UsageError, match="exceeds"):
        GenerationParams.from_mapping({"strategy": "dream", "gen_length": 8, "denoise_steps": 20})
    fast = GenerationParams.from_mapping({"strategy": "fast", "gen_length": 16, "block_length": 8})
    assert fast.steps_for(3) == fast.schedule.steps_per_block
    monkeypatch.setitem(STRATEGIES, "fast", replace(STRATEGIES["fast"], steps="per_token"))
    assert fast.steps_for(3) == [16]
