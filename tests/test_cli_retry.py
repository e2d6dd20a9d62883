"""`celeris retry` checks what it is given: a failure log, well-formed records, attempts counted for
every kind of record, and line-level user errors left alone unless forced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app

from .spool_helpers import make_queue

runner = CliRunner()


def record(key: str, **fields: Any) -> dict[str, Any]:
    base = {"key": key, "code": "engine_error", "retryable": True, "attempt": 1,
            "request": {"custom_id": key, "prompt": "p"}}  # fmt: skip
    return {**base, **fields}


def retry(tmp_path: Path, lines: list[str], *extra: str):  # type: ignore[no-untyped-def]
    config = make_queue(tmp_path, max_attempts=3)
    log = tmp_path / "logs" / "failed.jsonl"
    log.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return runner.invoke(app, ["retry", str(log), "--config", str(config), "--no-run", "--json", *extra])


def test_a_results_file_is_not_a_failure_log(tmp_path: Path) -> None:
    result_line = {"id": "a.txt:1", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    r = retry(tmp_path, [json.dumps(result_line)])
    assert r.exit_code == 2 and "is not a failure log" in r.stderr and "Traceback" not in r.output


def test_a_garbage_file_is_not_a_failure_log(tmp_path: Path) -> None:
    r = retry(tmp_path, ["hello", "world"])
    assert r.exit_code == 2 and "is not a failure log" in r.stderr


def test_malformed_records_are_skipped_with_line_numbered_warnings(tmp_path: Path) -> None:
    lines = [json.dumps(record("a")), json.dumps(record("b", attempt="first")),
             json.dumps(record("c", attempt=None)), '{"key": "torn']  # fmt: skip
    r = retry(tmp_path, lines)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["resubmitted"] == 1 and json.loads(r.stdout)["malformed"] == 3
    assert "failed.jsonl:2: skipped: attempt must be a positive integer, got 'first'" in r.stderr
    assert "failed.jsonl:3: skipped: attempt must be a positive integer, got None" in r.stderr
    assert "failed.jsonl:4: skipped" in r.stderr and "Traceback" not in r.output


def test_line_level_user_errors_are_retried_only_with_force(tmp_path: Path) -> None:
    bad = json.dumps(record("u", code="bad_param", retryable=False))
    assert json.loads(retry(tmp_path, [bad], "--all").stdout)["user_errors"] == 1
    forced = json.loads(retry(tmp_path, [bad], "--force").stdout)
    assert forced["resubmitted"] == 1 and forced["user_errors"] == 0


def test_attempts_count_from_the_request_when_the_record_says_1(tmp_path: Path) -> None:
    # a line-level error is recorded with attempt 1, but its request carries the attempt it was sent as
    request = {"custom_id": "x", "prompt": "p", "_celeris": {"attempt": 3}}
    rec = record("x", code="model_error", retryable=False, request=request)
    r = json.loads(retry(tmp_path, [json.dumps(rec)], "--all").stdout)
    assert r["resubmitted"] == 0 and r["out_of_attempts"] == 1


def test_resubmitted_request_carries_its_attempt_counted_up(tmp_path: Path) -> None:
    r = json.loads(retry(tmp_path, [json.dumps(record("a", attempt=2))]).stdout)
    [line] = (tmp_path / "batch_inputs" / r["file"]).read_text(encoding="utf-8").splitlines()
    assert json.loads(line)["_celeris"]["attempt"] == 3


def test_failures_of_two_files_with_the_same_ids_are_retried_without_a_duplicate_id(tmp_path: Path) -> None:
    # .txt ids are line-N: the same id in two files; one retry file would hold it twice
    recs = [
        record(f"{n}/{f}:2:1", custom_id="line-2", source={"file": f, "line": 2}, request={"custom_id": "line-2"})
        for n, f in ((1, "a.txt"), (2, "b.txt"))
    ]
    for rec in recs:
        rec["request"]["prompt"] = f"from {rec['source']['file']}"
    r = json.loads(retry(tmp_path, [json.dumps(x) for x in recs]).stdout)
    assert r["resubmitted"] == 2 and len(r["files"]) == 2
    for name in r["files"]:
        ids = [json.loads(x)["custom_id"] for x in (tmp_path / "batch_inputs" / name).read_text().splitlines()]
        assert ids == ["line-2"]


def test_a_full_disk_under_logs_is_one_error_line_with_exit_74_and_leaves_nothing_queued(tmp_path: Path) -> None:
    from .test_spool_hostile import tmpfs_at, write_files

    recs = [json.dumps(record(k)) for k in ("a", "b")]
    config = make_queue(tmp_path, max_attempts=3)
    log = tmp_path / "logs" / "failed.jsonl"
    mounted = tmpfs_at(tmp_path / "logs", 0, lambda logs: write_files(logs, {"failed.jsonl": "\n".join(recs) + "\n"}))
    filler = next(mounted)
    try:
        r = runner.invoke(app, ["retry", str(log), "--config", str(config), "--no-run"])
        assert r.exit_code == 74, r.exception
        assert r.stderr.startswith("Error: ") and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.output
        assert [p.name for p in (tmp_path / "batch_inputs").glob("retry-*")] == []  # nothing queued twice later
        filler.unlink()
        r = runner.invoke(app, ["retry", str(log), "--config", str(config), "--no-run", "--json"])
        assert r.exit_code == 0 and json.loads(r.stdout)["resubmitted"] == 2
    finally:
        next(mounted, None)


def test_the_retry_ledger_is_written_in_one_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from celeris_cli.spool import ops

    appends: list[str] = []
    real = ops.append_line
    monkeypatch.setattr(ops, "append_line", lambda path, text, *a, **k: (appends.append(text), real(path, text))[1])
    recs = [record(f"{k}", source={"file": f, "line": 1}) for k, f in (("a", "x.txt"), ("b", "x.txt"), ("c", "y.txt"))]
    r = retry(tmp_path, [json.dumps(x) for x in recs])
    assert r.exit_code == 0 and json.loads(r.stdout)["resubmitted"] == 3
    assert len(appends) == 1 and len(appends[0].splitlines()) == 3
    ledger = [json.loads(x)["key"] for x in (tmp_path / "logs" / "retried.jsonl").read_text().splitlines()]
    assert sorted(ledger) == ["a", "b", "c"]
