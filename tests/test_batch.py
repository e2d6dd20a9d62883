"""`celeris batch`: one file in, results in input order and one failure record per bad line out, written
atomically; the same on a local Ray actor pool, byte-identical, even when an actor dies mid-run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from celeris_cli.batch import run_file
from celeris_cli.batch.local import LocalExecutor

from .spool_helpers import FakeBackend

REPO = Path(__file__).parents[1]
PROMPTS = ["床前明月光，", "白日依山尽，", "Shall I compare thee", "春眠不觉晓，", "The jury said it", "红豆"]


def mixed_requests(path: Path, n: int = 100) -> tuple[set[str], set[int]]:
    """n lines, 3 of them bad (broken JSON, a bad setting, no prompt); returns good ids and bad lines."""
    lines, good, bad = [], set(), set()
    for i in range(n):
        if i in (17, 48, 90):
            lines.append(
                ['{"id": "b17", "prompt": ', '{"id": "b48", "prompt": "x", "temperature": -1}', '{"id": "b90"}'][
                    (17, 48, 90).index(i)
                ]
            )
            bad.add(i + 1)
        elif i % 4 == 0:
            body = {"prompt": PROMPTS[i % 6], "max_tokens": 16, "seed": i}
            lines.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body}))
            good.add(f"q{i}")
        else:
            lines.append(json.dumps({"id": f"q{i}", "prompt": PROMPTS[i % 6] * (1 + i % 3), "seed": i % 7}))
            good.add(f"q{i}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return good, bad


def celeris(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "celeris_cli", *args], env=full, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def check(out: Path, failed: Path, good: set[str], bad: set[int]) -> list[dict]:
    results = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    lines = [int(r["id"].rsplit(":", 1)[1]) for r in results]
    assert lines == sorted(lines)  # input order
    assert sorted(r["custom_id"] for r in results) == sorted(good)  # exactly one per good request
    fails = [json.loads(x) for x in failed.read_text(encoding="utf-8").splitlines()]
    assert sorted(f["source"]["line"] for f in fails) == sorted(bad)  # exactly one per bad line
    assert not list(out.parent.glob(".*.tmp"))  # nothing half-written left behind
    return results


def test_local_batch_gives_one_result_per_good_request_and_one_record_per_bad_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    good, bad = mixed_requests(tmp_path / "in.jsonl")
    p = celeris("batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model",
                str(tiny_model), "--device", "cpu", "--set", '{"denoise_steps": 8, "gen_length": 16}')  # fmt: skip
    assert p.returncode == 1, p.stderr  # some requests failed
    assert p.stdout == "" and "97 results, 3 failures of 100 requests" in p.stderr
    results = check(tmp_path / "out.jsonl", tmp_path / "out.jsonl.failed.jsonl", good, bad)
    assert all(r["response"]["body"]["settings"]["denoise_steps"] == 8 for r in results)
    codes = {f["custom_id"]: f["code"] for f in map(json.loads, (tmp_path / "out.jsonl.failed.jsonl").open())}
    assert codes == {None: "invalid_json", "b48": "bad_param", "b90": "missing_prompt"}


def test_a_poison_request_fails_alone_and_its_batch_mates_are_served(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("".join(f"prompt {i}\n" for i in range(10)) + "poison here\n")
    backend = FakeBackend(fail_on="poison")
    report = run_file(tmp_path / "in.txt", tmp_path / "o.jsonl", tmp_path / "f.jsonl", LocalExecutor(backend, 16))
    assert (report.results, report.failures) == (10, 1)
    [rec] = map(json.loads, (tmp_path / "f.jsonl").open())
    assert rec["custom_id"] == "line-11" and rec["code"] == "engine_error" and rec["retryable"] is True
    assert max(map(len, backend.batches)) == 11  # it was tried in the full batch first, then bisected


def test_failure_records_name_the_results_file_the_run_wrote(tmp_path: Path) -> None:
    (tmp_path / "req.jsonl").write_text('{"id": "ok", "prompt": "a"}\n{"id": "bad"}\n{"id": "p", "prompt": "poison"}\n')
    out = tmp_path / "res.jsonl"
    run_file(tmp_path / "req.jsonl", out, tmp_path / "f.jsonl", LocalExecutor(FakeBackend(fail_on="poison"), 16))
    records = [json.loads(x) for x in (tmp_path / "f.jsonl").open()]
    assert [r["custom_id"] for r in records] == ["bad", "p"]  # a line that is not a request, and a failed one
    assert {r["output"] for r in records} == {str(out.resolve())}


def in_process(*args: str) -> Any:
    """`celeris ARGS` in this process (a usage error needs no process of its own): exit_code, stderr, and
    `exception`, a SystemExit unless one escaped the CLI (what would print a traceback)."""
    from typer.testing import CliRunner

    from celeris_cli.cli import app
    from celeris_cli.cli.batch import _optional_ray_address

    return CliRunner().invoke(app, _optional_ray_address(list(args)))  # as `main` hands it the command line


def test_unreadable_input_is_a_usage_error(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "in.csv").write_text("a,b\n")
    p = in_process("batch", "-i", str(tmp_path / "in.csv"), "-o", str(tmp_path / "o.jsonl"), "--model", str(tiny_model))
    assert p.exit_code == 2 and "unsupported file type" in p.stderr
    assert isinstance(p.exception, SystemExit)  # a clean exit, no exception escaping (no traceback)
    assert not (tmp_path / "o.jsonl").exists()


def test_ray_run_is_byte_identical_to_local_and_survives_a_killed_actor(tmp_path: Path, tiny_model: Path) -> None:
    pytest.importorskip("ray")
    good, bad = mixed_requests(tmp_path / "in.jsonl", n=60)
    sampling = '{"denoise_steps": 8, "gen_length": 16, "temperature": 1.0, "order_temperature": 1.0}'
    common = ["-i", str(tmp_path / "in.jsonl"), "--model", str(tiny_model), "--device", "cpu", "--batch-size", "8",
              "--set", sampling]  # fmt: skip
    local = celeris("batch", *common, "-o", str(tmp_path / "local.jsonl"))
    assert local.returncode == 1, local.stderr
    marker = tmp_path / "crashed"
    ray = celeris("batch", *common, "-o", str(tmp_path / "ray.jsonl"), "--ray", "--actors", "2",
                  env={"CELERIS_RAY_CRASH_ONCE": str(marker)})  # fmt: skip
    assert ray.returncode == 1, ray.stderr
    assert marker.exists()  # an actor did die mid-batch; Ray restarted it and redid its batch
    assert ray.stdout == ""  # Ray's own logging stays off stdout
    r_local = check(tmp_path / "local.jsonl", tmp_path / "local.jsonl.failed.jsonl", good, bad)
    r_ray = check(tmp_path / "ray.jsonl", tmp_path / "ray.jsonl.failed.jsonl", good, bad)
    texts = [(r["custom_id"], r["response"]["body"]["text"]) for r in r_local]
    assert texts == [(r["custom_id"], r["response"]["body"]["text"]) for r in r_ray]
    assert max(r["response"]["body"]["timing"]["batch_size"] for r in r_ray) <= 8  # --batch-size reached the actors
    # the rows decode in running sets (the fast strategy's waves) as wide as --batch-size, locally and in
    # each actor: every answer reports that width
    sizes = [r["response"]["body"]["timing"]["batch_size"] for r in r_local]
    assert sizes == [r["response"]["body"]["timing"]["batch_size"] for r in r_ray] == [8] * len(sizes)
    assert len({t for _, t in texts}) > 10  # sampled answers (default temperature), not one repeated text


def test_a_missing_output_folder_or_model_is_a_usage_error_before_any_decoding(
    tmp_path: Path, tiny_model: Path
) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    p = in_process("batch", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "nope" / "o.jsonl"), "--model",
                str(tiny_model))  # fmt: skip
    assert p.exit_code == 2 and "does not exist" in p.stderr and isinstance(p.exception, SystemExit)
    if importlib.util.find_spec("ray") is not None:  # the Ray path checks the model on the driver, before Ray
        p = in_process("batch", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "o.jsonl"), "--ray", "--model",
                    str(tmp_path / "no-model"))  # fmt: skip
        assert p.exit_code == 2 and "model folder not found" in p.stderr and isinstance(p.exception, SystemExit)
        p = in_process("batch", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "o.jsonl"), "--ray", "--model",
                    str(tiny_model), "--set", '{"strategy": "reference", "threshold": 0.5}')  # fmt: skip
        assert p.exit_code == 2 and "threshold: not used by the reference strategy" in p.stderr


def test_ray_missing_is_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from celeris_cli.batch.ray_pool import import_ray
    from celeris_cli.errors import UsageError

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UsageError) as caught:
        import_ray()
    assert "pip install -e '.[ray]'" in str(caught.value)  # from a clone: Celeris is on no package index
    assert "celeris[ray]" not in str(caught.value)


def test_the_batch_bench_reports_a_run_per_executor_with_its_prompts_per_s(tmp_path: Path, tiny_model: Path) -> None:
    """`bench_batch`'s report from its local run. Its Ray runs are the executor the test above runs through
    the CLI (byte-identical to local, an actor killed); a Ray start of its own here took 25 to 35 s of a CI
    worker for the same property."""
    from celeris_cli.measure.bench import bench_batch

    report = bench_batch(6, 4, tmp_path, {"model": str(tiny_model), "device": "cpu", "dtype": "float32"}, actors=())
    (name, run), *more = report["runs"].items()
    assert name == "local" and more == [] and report["prompts"] == 6 and report["batch_size"] == 4
    assert run["results"] == 6 and run["prompts_per_s"] > 0 and run["wall_s"] > 0
    assert run["overhead_vs_local"] == 0.0
    texts = [json.loads(x)["response"]["body"]["text"] for x in (tmp_path / "local.jsonl").read_text().splitlines()]
    assert len(texts) == 6 and all(texts)  # the answers the comparison is made on
