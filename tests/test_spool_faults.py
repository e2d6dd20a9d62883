"""Faults the queue must survive in-process (issue #11): poison requests, reused names, full disks,
files that change after they are claimed. Kill and signal cases are in test_spool_faults_process.py."""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from celeris_cli.errors import EXIT_IO
from celeris_cli.spool.backend import Prepared
from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool
from celeris_cli.spool.formats import Request
from celeris_cli.spool.ops import plan_retry

from .spool_helpers import FakeBackend, drop, failures, make_queue, outputs


def serve(root: Path, backend: FakeBackend | None = None, **cfg: object) -> tuple[int, FakeBackend]:
    backend = backend or FakeBackend()
    spool = Spool(load_config(make_queue(root, **cfg)), lambda: backend)
    return spool.run(once=True), backend


class TokenizerCrash(FakeBackend):
    """prepare raises something that is not a CelerisError, as a tokenizer does on odd input."""

    def prepare(self, request: Request) -> Prepared:
        if "poison" in (request.prompt or ""):
            raise RuntimeError("tokenizer: internal error")
        return super().prepare(request)


def test_any_exception_while_preparing_a_request_fails_only_that_request(tmp_path: Path) -> None:
    drop(tmp_path, "a.txt", "fine\npoison here\nalso fine\n", age_s=20)
    drop(tmp_path, "b.txt", "served too\n", age_s=10)
    rc, _ = serve(tmp_path, backend=TokenizerCrash())
    assert rc == 1
    assert [r["custom_id"] for r in outputs(tmp_path)["a.txt.results.jsonl"]] == ["line-1", "line-3"]
    assert len(outputs(tmp_path)["b.txt.results.jsonl"]) == 1
    [rec] = failures(tmp_path)
    assert rec["custom_id"] == "line-2" and rec["code"] == "prepare_error" and "internal error" in rec["message"]


def test_lone_surrogates_in_ids_and_prompts_are_invalid_utf8_records(tmp_path: Path) -> None:
    lines = [
        '{"id": "bad", "prompt": "lone \\ud800 surrogate"}',
        '{"id": "\\udc80", "prompt": "x"}',
        '{"id": "m", "messages": [{"role": "user", "content": "\\udfff"}]}',
        '{"id": "ok", "prompt": "fine"}',
    ]
    drop(tmp_path, "s.jsonl", "\n".join(lines) + "\n", age_s=20)
    drop(tmp_path, "b.txt", "beside it\n", age_s=10)
    rc, _ = serve(tmp_path)
    assert rc == 1
    assert [r["custom_id"] for r in outputs(tmp_path)["s.jsonl.results.jsonl"]] == ["ok"]
    assert len(outputs(tmp_path)["b.txt.results.jsonl"]) == 1
    recs = failures(tmp_path)
    assert sorted(r["source"]["line"] for r in recs) == [1, 2, 3]
    assert {r["code"] for r in recs} == {"invalid_utf8"}
    (tmp_path / "logs" / "failed.jsonl").read_bytes().decode("utf-8")  # the log itself stays valid UTF-8


def test_a_batch_exception_is_bisected_so_only_the_poison_request_fails(tmp_path: Path) -> None:
    drop(tmp_path, "p.txt", "".join(f"prompt {i}\n" for i in range(7)) + "explode\n")
    rc, backend = serve(tmp_path, backend=FakeBackend(fail_on="explode"), batch_size=8)
    assert rc == 1
    assert len(outputs(tmp_path)["p.txt.results.jsonl"]) == 7
    [rec] = failures(tmp_path)
    assert rec["custom_id"] == "line-8" and rec["code"] == "engine_error" and rec["retryable"]
    assert len(backend.batches) <= 2 * 3 + 1  # a bisection, not one retry per request


class Hangs(FakeBackend):
    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        if any("forever" in p.payload for p in batch):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a decode loop that never ends (steps of Python work)
                time.sleep(0.01)
        return super().run(batch)


def test_request_timeout_fails_the_request_that_runs_too_long_and_serves_the_rest(tmp_path: Path) -> None:
    drop(tmp_path, "t.txt", "quick\nforever\nquick too\n")
    t0 = time.monotonic()
    rc, _ = serve(tmp_path, backend=Hangs(), request_timeout_s=0.3)
    assert time.monotonic() - t0 < 10
    assert rc == 1
    assert [r["custom_id"] for r in outputs(tmp_path)["t.txt.results.jsonl"]] == ["line-1", "line-3"]
    [rec] = failures(tmp_path)
    assert rec["custom_id"] == "line-2" and rec["code"] == "timeout"


def test_a_name_reused_after_processed_was_cleared_gets_its_own_identity(tmp_path: Path) -> None:
    drop(tmp_path, "daily.jsonl", '{"id": "a", "prompt": "first"}\n{broken\n')
    serve(tmp_path)
    shutil.rmtree(tmp_path / "batch_processed")
    (tmp_path / "batch_processed").mkdir()
    drop(tmp_path, "daily.jsonl", '{"id": "a", "prompt": "second"}\n{broken again\n')
    rc, _ = serve(tmp_path)
    assert rc == 1
    texts = sorted(r["response"]["body"]["text"] for recs in outputs(tmp_path).values() for r in recs)
    assert texts == ["dnoces", "tsrif"]  # the first results were not overwritten
    recs = failures(tmp_path)
    assert len(recs) == 2 and len({r["key"] for r in recs}) == 2  # the second bad line has its record


def test_retry_never_resubmits_an_id_that_already_has_a_result(tmp_path: Path) -> None:
    drop(tmp_path, "r.jsonl", '{"id": "x", "prompt": "explode"}\n')
    serve(tmp_path, backend=FakeBackend(fail_on="explode"))
    [rec] = failures(tmp_path)
    # the same id later got a result under the same claim (a crash between the two, then a rerun)
    results = tmp_path / "batch_outputs" / "r.jsonl.results.jsonl"
    results.write_text(json.dumps({"id": "r.jsonl:1", "custom_id": "x", "response": {}, "error": None}) + "\n")
    cfg = load_config(tmp_path / "configs" / "batch.yaml")
    report = plan_retry(cfg, tmp_path / "logs" / "failed.jsonl", include_all=False)
    assert report.resubmitted == 0 and report.already_done == 1


def test_full_disk_on_publish_backs_off_without_failure_records_and_younger_files_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celeris_cli.spool import fsutil

    real = fsutil.stage
    blocked = {"on": True}

    def stage(path: Path, data: bytes) -> Path:
        if blocked["on"] and path.name.startswith("big"):
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data[: len(data) // 2])  # half written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        return real(path, data)

    monkeypatch.setattr(fsutil, "stage", stage)
    drop(tmp_path, "big.txt", "".join(f"long prompt {i}\n" for i in range(20)), age_s=30)
    drop(tmp_path, "small.txt", "younger\n", age_s=10)
    config = make_queue(tmp_path, publish_retry_s=0.05)
    spool = Spool(load_config(config), FakeBackend)
    assert spool.run(once=True) == EXIT_IO  # --once gives up for now: the big file stays claimed, not failed
    assert "small.txt.results.jsonl" in outputs(tmp_path) and failures(tmp_path) == []
    assert not [p for p in (tmp_path / "batch_outputs").iterdir() if p.name.endswith(".tmp")]
    events = [json.loads(x) for x in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "publish_blocked" and e["errno"] == "ENOSPC" for e in events)
    blocked["on"] = False
    backend = FakeBackend()
    assert Spool(load_config(config), lambda: backend).run(once=True) == 0
    assert len(outputs(tmp_path)["big.txt.results.jsonl"]) == 20
    assert backend.batches == []  # its results were journaled: nothing decoded twice


def test_metrics_textfile_counts_results_failures_by_code_and_queue_depth(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    drop(tmp_path, "m.jsonl", '{"id": "a", "prompt": "x"}\n{broken\n{"id": "b", "prompt": "y"}\n')
    (tmp_path / "metrics").mkdir()
    rc, _ = serve(tmp_path, metrics_textfile="metrics/celeris.prom")
    assert rc == 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families((tmp_path / "metrics" / "celeris.prom").read_text())
        for s in family.samples
    }
    assert samples[("celeris_queue_requests_done_total", ())] == 2
    assert samples[("celeris_queue_requests_failed_total", (("code", "invalid_json"),))] == 1
    assert samples[("celeris_queue_batches_total", ())] == 1
    assert samples[("celeris_queue_depth", ())] == 0 and samples[("celeris_queue_claimed", ())] == 0
    assert samples[("celeris_queue_last_success_timestamp_seconds", ())] > time.time() - 60


def test_status_shows_the_age_of_the_last_batch(tmp_path: Path) -> None:
    from celeris_cli.spool.ops import status

    drop(tmp_path, "a.txt", "x\n")
    serve(tmp_path)
    hb = status(load_config(tmp_path / "configs" / "batch.yaml"))["heartbeat"]
    assert hb["state"] == "stopped" and 0 <= hb["last_batch_age_s"] < 60


def test_a_file_left_claimed_by_an_older_version_is_served_not_lost(tmp_path: Path) -> None:
    make_queue(tmp_path)
    work = tmp_path / "batch_inputs" / ".work"
    work.mkdir(parents=True)
    (work / "old.txt").write_text("left behind\n")  # the old layout: .work/<name>, no claim number
    drop(tmp_path, "old.txt", "a new file of the same name\n")
    rc, _ = serve(tmp_path)
    assert rc == 0
    texts = sorted(r["response"]["body"]["text"] for recs in outputs(tmp_path).values() for r in recs)
    assert texts == sorted(["dniheb tfel", "eman emas eht fo elif wen a"])


def test_a_blocked_publish_journals_its_outcomes_once_however_often_it_is_retried(tmp_path: Path) -> None:
    """Each retry of a publish the disk refuses used to journal every outcome again (100 records for a
    20-line file after five retries), which a Batch API status read then counted as answers."""
    from types import SimpleNamespace

    from celeris_cli.spool.finish import Finisher

    appended: list[dict[str, Any]] = []
    job: Any = SimpleNamespace(
        seq=7, name="f.txt", outcomes={i: {"line": i, "body": {}} for i in range(1, 21)},
        journal=SimpleNamespace(append=appended.append),
    )  # fmt: skip
    finisher: Any = Finisher.__new__(Finisher)
    finisher.deferred, finisher.f = {}, SimpleNamespace(outputs=tmp_path)
    finisher.cfg = SimpleNamespace(publish_retry_s=0.01)
    finisher.events = lambda *a, **k: None
    for _ in range(5):
        finisher.blocked_or_raise(job, OSError(errno.ENOSPC, "No space left on device"))
    assert sum(len(rec["outcomes"]) for rec in appended) == 20
    assert finisher.deferred[7].blocked == 5
