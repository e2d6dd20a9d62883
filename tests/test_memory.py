"""The memory planner: what it adds up grows with what it should, int8 shrinks the weights, the largest
batch is the largest that fits, `celeris inspect --memory` prints the split, and `--max-memory` changes
the batches the engine decodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from celeris_cli import load_engine
from celeris_cli.arch.memory import Request, largest_batch, parse_size, plan, weights_bytes
from celeris_cli.arch.memory_sizes import shape_from_dims
from celeris_cli.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
LLADA_8B = shape_from_dims(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=12288, rows=126464)
BASE = Request("fast", batch=4, prompt=64, gen_length=256, block_length=32, dtype="bfloat16")


def celeris(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "celeris_cli", *args], env=env, capture_output=True, text=True)


def test_a_published_shape_counts_its_published_parameters() -> None:
    assert 7.9e9 < LLADA_8B.params < 8.1e9  # LLaDA-8B: 8.0B


@pytest.mark.parametrize("field", ["batch", "gen_length", "prompt"])
def test_the_peak_grows_with_the_batch_and_the_lengths(field: str) -> None:
    small, large = plan(LLADA_8B, BASE), plan(LLADA_8B, replace(BASE, **{field: 2 * getattr(BASE, field)}))
    assert large.peak > small.peak and large.weights == small.weights
    assert large.kv_cache > small.kv_cache  # the fast decoder's cache spans every row's canvas


@pytest.mark.parametrize("strategy", ["fast", "block-fast", "block", "reference", "dream"])
def test_every_strategy_is_planned_and_guidance_doubles_the_working_state(strategy: str) -> None:
    one, two = (
        plan(LLADA_8B, replace(BASE, strategy=strategy)),
        plan(LLADA_8B, replace(BASE, strategy=strategy, views=2)),
    )
    assert one.weights == two.weights and two.peak - two.weights > one.peak - one.weights > 0


def test_int8_weights_are_at_most_0_55_of_bfloat16() -> None:
    assert weights_bytes(LLADA_8B, "bfloat16", "int8") <= 0.55 * weights_bytes(LLADA_8B, "bfloat16")
    assert plan(LLADA_8B, replace(BASE, quantize="int8")).peak < plan(LLADA_8B, BASE).peak


def test_the_largest_batch_is_the_largest_that_fits() -> None:
    budget = 24 * 2**30
    k = largest_batch(LLADA_8B, BASE, budget)
    assert k > 1
    assert plan(LLADA_8B, replace(BASE, batch=k)).peak <= budget < plan(LLADA_8B, replace(BASE, batch=k + 1)).peak
    assert largest_batch(LLADA_8B, BASE, 8 * 2**30) == 0  # bf16 weights alone are 15 GiB


def test_sizes_parse_with_units_and_a_bad_one_names_the_option() -> None:
    assert parse_size("8GiB") == 8 * 2**30 and parse_size("512MB") == 512 * 10**6 and parse_size("1.5gib") == 3 * 2**29
    with pytest.raises(UsageError, match="max-memory must be a size such as 8GiB"):
        parse_size("lots")


def test_inspect_memory_prints_the_split_and_the_largest_batch_within_max_memory() -> None:
    p = celeris(
        "inspect", "celeris-block", "--memory", "--batch-size", "16", "--gen-length", "256", "--max-memory", "8GiB"
    )
    assert p.returncode == 0, p.stderr
    for part in ("weights", "kv cache", "activations", "logits", "peak", "largest batch within 8.00 GiB"):
        assert part in p.stdout
    small = celeris("inspect", "celeris-block", "--memory", "--gen-length", "256", "--max-memory", "256MiB", "--json")
    large = celeris("inspect", "celeris-block", "--memory", "--gen-length", "256", "--max-memory", "1GiB", "--json")
    assert json.loads(small.stdout)["largest_batch"] < json.loads(large.stdout)["largest_batch"]


def test_max_memory_caps_the_batches_and_leaves_the_answers_unchanged(tiny_model: Path) -> None:
    engine = load_engine(tiny_model, device="cpu", dtype="float32")
    params = engine.params({"gen_length": 16, "denoise_steps": 8, "block_length": 8})
    prompts = ["the cat", "a dog", "one", "birds sing", "rain", "the old road"]
    free = engine.generate(prompts, params, batch_size=6)
    budget = engine.memory.need([engine.encode_prompt(p) for p in prompts[:2]], params)
    capped = load_engine(tiny_model, device="cpu", dtype="float32", max_memory=budget)
    results = capped.generate(prompts, params, batch_size=6)
    assert max(r.batch_size for r in free) == 6 and max(r.batch_size for r in results) < 6
    assert [r.text for r in results] == [r.text for r in free]


def test_each_result_and_the_queue_metrics_carry_the_batch_peak_memory(engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from celeris_cli.spool.metrics import Metrics

    [result] = engine.generate(["the cat"], engine.params({"gen_length": 8, "denoise_steps": 4, "block_length": 8}))
    assert result.peak_memory_mb > 0 and "peak_memory_mb" in result.to_dict()
    metrics = Metrics(tmp_path / "celeris.prom")
    metrics.batch(8, 1.0, result.peak_memory_mb)
    metrics.write(force=True)
    [line] = [x for x in (tmp_path / "celeris.prom").read_text().splitlines() if x.startswith("celeris_queue_peak")]
    assert float(line.split()[1]) == result.peak_memory_mb * 2**20


def test_batch_yaml_takes_quantize_and_max_memory_and_refuses_bad_values_by_key(tmp_path: Path) -> None:
    from celeris_cli.errors import ConfigError
    from celeris_cli.spool.config import parse_config

    cfg = parse_config({"quantize": "int8", "max_memory": "8GiB"}, tmp_path / "batch.yaml")
    assert (cfg.quantize, cfg.max_memory) == ("int8", "8GiB")
    assert parse_config({"quantize": "int4"}, tmp_path / "batch.yaml").quantize == "int4"
    with pytest.raises(ConfigError, match="quantize: must be one of none, int8, int4, got 'int2'"):
        parse_config({"quantize": "int2"}, tmp_path / "batch.yaml")
    with pytest.raises(ConfigError, match="max_memory must be a size"):
        parse_config({"max_memory": "lots"}, tmp_path / "batch.yaml")
