"""The queue in-process, with a fake backend: formats, bad input, batching, retry, status."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from celeris_cli.errors import ConfigError
from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool
from celeris_cli.spool.ops import plan_retry, status

from .spool_helpers import FakeBackend, claimed, drop, failures, make_queue, outputs, visible


def serve(root: Path, backend: FakeBackend | None = None, **cfg: object) -> tuple[int, FakeBackend]:
    backend = backend or FakeBackend()
    spool = Spool(load_config(make_queue(root, **cfg)), lambda: backend)
    return spool.run(once=True), backend


def test_txt_jsonl_and_openai_formats_produce_keyed_outputs(tmp_path: Path) -> None:
    drop(tmp_path, "a.txt", "\ufeff床前明月光，\r\n\r\nTo be\r\n")
    drop(tmp_path, "b.jsonl", json.dumps({"id": "x1", "prompt": "hello", "temperature": 0.5}) + "\n")
    openai = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "春眠"}], "max_tokens": 9},
    }
    drop(tmp_path, "诗.jsonl", json.dumps(openai, ensure_ascii=False) + "\n")
    code, _ = serve(tmp_path)
    assert code == 0
    out = outputs(tmp_path)
    assert [r["custom_id"] for r in out["a.txt.results.jsonl"]] == ["line-1", "line-3"]
    assert out["a.txt.results.jsonl"][0]["response"]["body"]["text"] == "，光月明前床"
    assert out["b.jsonl.results.jsonl"][0]["custom_id"] == "x1"
    rec = out["诗.jsonl.results.jsonl"][0]
    assert rec["custom_id"] == "req-1" and rec["error"] is None and rec["response"]["status_code"] == 200
    assert visible(tmp_path / "batch_processed") == [
        "a.txt",
        "b.jsonl",
        "诗.jsonl",
    ]
    assert claimed(tmp_path) == []


BAD_LINES = {
    "invalid_json": "{not json",
    "missing_prompt": json.dumps({"id": "m"}),
    "bad_param": json.dumps({"id": "p", "prompt": "x", "gen_length": "eight"}),
    "invalid_id": json.dumps({"id": "../../etc/passwd", "prompt": "x"}),
    "line_too_long": json.dumps({"id": "h", "prompt": "x" * 5000}),
    "prompt_too_long": json.dumps({"id": "L", "prompt": "y" * 1500}),
}


def test_each_bad_line_is_a_clear_record_and_good_lines_still_run(tmp_path: Path) -> None:
    good = [json.dumps({"id": f"g{i}", "prompt": f"good {i}"}) for i in range(3)]
    lines = [good[0], *BAD_LINES.values(), good[1], json.dumps({"id": "g0", "prompt": "dup"}), good[2]]
    data = ("\n".join(lines) + "\n").encode() + b'{"id": "u", "prompt": "\xff\xfe"}\n'
    drop(tmp_path, "mixed.jsonl", data)
    code, _ = serve(tmp_path, max_line_bytes=4000)
    assert code == 1
    out = outputs(tmp_path)["mixed.jsonl.results.jsonl"]
    assert [r["custom_id"] for r in out] == ["g0", "g1", "g2"]
    recs = {r["code"]: r for r in failures(tmp_path)}
    assert set(recs) == {*BAD_LINES, "duplicate_id", "invalid_utf8"}
    for rec in recs.values():
        assert rec["message"] and rec["source"]["file"] == "mixed.jsonl" and rec["source"]["line"] > 0
        assert rec["retryable"] is False and rec["attempt"] == 1 and rec["time"]
    assert recs["duplicate_id"]["custom_id"] == "g0"
    assert recs["bad_param"]["request"]["gen_length"] == "eight"
    assert not any(p.name == "passwd" for p in tmp_path.rglob("passwd"))


@pytest.mark.parametrize(
    "name,content,code",
    [
        ("empty.txt", b"", "empty_file"),
        ("blank.jsonl", b"\n\n  \n", "empty_file"),
        ("bin.jsonl", b"\x00\x01\x02binary\x00", "binary_file"),
        ("latin1.txt", "caf\xe9 cr\xe8me".encode("latin-1"), "invalid_utf8"),
        ("data.csv", b"a,b\n", "unsupported_format"),
    ],
)
def test_unreadable_files_are_quarantined_and_the_next_file_is_served(
    tmp_path: Path, name: str, content: bytes, code: str
) -> None:
    drop(tmp_path, name, content, age_s=20)
    drop(tmp_path, "next.txt", "still served\n", age_s=10)
    rc, _ = serve(tmp_path)
    assert rc == 1
    assert (tmp_path / "batch_processed" / "quarantine" / name).exists()
    [rec] = failures(tmp_path)
    assert rec["code"] == code and rec["source"] == {"file": name, "line": 0}
    assert outputs(tmp_path)["next.txt.results.jsonl"][0]["response"]["body"]["text"] == "devres llits"


def test_symlink_in_inbox_is_quarantined_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read\n")
    make_queue(tmp_path)
    link = tmp_path / "batch_inputs" / "link.txt"
    os.symlink(secret, link)
    os.utime(link, (1, 1), follow_symlinks=False)
    rc, backend = serve(tmp_path)
    assert rc == 1 and backend.batches == []
    assert [r["code"] for r in failures(tmp_path)] == ["symlink"]
    assert (tmp_path / "batch_processed" / "quarantine" / "link.txt").is_symlink()
    assert secret.read_text() == "do not read\n"


def test_hidden_temp_and_partial_files_are_ignored(tmp_path: Path) -> None:
    make_queue(tmp_path)
    for name in (".hidden.txt", "x.tmp", "y.part"):
        (tmp_path / "batch_inputs" / name).write_text("p\n")
        os.utime(tmp_path / "batch_inputs" / name, (1, 1))
    rc, backend = serve(tmp_path)
    assert rc == 0 and backend.batches == []
    names = sorted(p.name for p in (tmp_path / "batch_inputs").iterdir())
    assert names == [".celeris.lock", ".hidden.txt", ".work", "x.tmp", "y.part"]


def test_a_file_still_growing_waits_for_the_settle_time(tmp_path: Path) -> None:
    drop(tmp_path, "old.txt", "ready\n", age_s=100)
    drop(tmp_path, "torn.jsonl", '{"id": "a", "prompt": "half', age_s=0)  # no final newline, just written
    drop(tmp_path, "whole.jsonl", '{"id": "b", "prompt": "all"}\n', age_s=0)
    spool = Spool(load_config(make_queue(tmp_path, settle_s=60)), FakeBackend)
    spool.start()
    ready, waiting = spool.inbox.scan()
    assert [p.name for p in ready] == ["old.txt"] and waiting == 2
    # a complete-looking file that did not change between two scans is read before the settle time
    ready, waiting = spool.inbox.scan()
    assert [p.name for p in ready] == ["old.txt", "whole.jsonl"] and waiting == 1
    with open(tmp_path / "batch_inputs" / "whole.jsonl", "a") as f:
        f.write('{"id": "c", "prompt": "more"}\n')  # it grows again: back to waiting
    ready, waiting = spool.inbox.scan()
    assert [p.name for p in ready] == ["old.txt"] and waiting == 2
    spool.lock.release()


def test_requests_from_many_files_are_packed_into_batches(tmp_path: Path) -> None:
    for i in range(200):
        drop(tmp_path, f"p{i:03d}.txt", f"prompt number {i}\n")
    rc, backend = serve(tmp_path, batch_size=16)
    assert rc == 0
    sizes = [len(b) for b in backend.batches]
    assert sum(sizes) == 200 and max(sizes) == 16 and len(sizes) <= 200 // 16 + 2
    assert len(outputs(tmp_path)) == 200
    events = [json.loads(x) for x in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    assert [e["size"] for e in events if e["event"] == "batch"] == sizes


def test_incompatible_settings_are_not_batched_together(tmp_path: Path) -> None:
    lines = [json.dumps({"id": f"a{i}", "prompt": "p", "temperature": 0.5}) for i in range(3)]
    lines += [json.dumps({"id": f"b{i}", "prompt": "p", "gen_length": 4}) for i in range(3)]
    drop(tmp_path, "m.jsonl", "\n".join(lines) + "\n")
    _, backend = serve(tmp_path)
    assert sorted(backend.batches) == [["a0", "a1", "a2"], ["b0", "b1", "b2"]]


def test_token_budget_splits_batches(tmp_path: Path) -> None:
    drop(tmp_path, "t.txt", "".join(f"{'x' * 40}{i}\n" for i in range(10)))  # cost about 50 tokens each
    _, backend = serve(tmp_path, token_budget=200, batch_size=16)
    assert all(len(b) <= 4 for b in backend.batches) and sum(map(len, backend.batches)) == 10


def test_engine_failure_is_retryable_and_retry_runs_it_once(tmp_path: Path) -> None:
    drop(
        tmp_path,
        "r.jsonl",
        json.dumps({"id": "boom", "prompt": "explode"})
        + "\n"
        + json.dumps({"id": "ok", "prompt": "fine", "gen_length": 4})
        + "\n",
    )
    rc, _ = serve(tmp_path, backend=FakeBackend(fail_on="explode"))
    assert rc == 1
    [rec] = failures(tmp_path)
    assert rec["code"] == "engine_error" and rec["retryable"] and rec["request"]["prompt"] == "explode"
    cfg = load_config(tmp_path / "configs" / "batch.yaml")
    log = tmp_path / "logs" / "failed.jsonl"
    before = log.read_bytes()
    report = plan_retry(cfg, log, include_all=False)
    assert report.resubmitted == 1 and report.file
    again = plan_retry(cfg, log, include_all=False)
    assert again.resubmitted == 0 and again.already_retried == 1  # idempotent
    assert log.read_bytes() == before  # the log is never rewritten
    rc, _ = serve(tmp_path)
    assert rc == 0
    out = outputs(tmp_path)[f"{report.file}.results.jsonl"]
    assert [r["custom_id"] for r in out] == ["boom"]


def test_retry_respects_max_attempts_and_retryable_flag(tmp_path: Path) -> None:
    make_queue(tmp_path, max_attempts=2)
    log = tmp_path / "logs" / "failed.jsonl"
    recs = [
        {"key": "f:1:2", "retryable": True, "attempt": 2, "request": {"custom_id": "a", "prompt": "p"}},
        {"key": "f:2:1", "retryable": False, "attempt": 1, "request": {"custom_id": "b", "prompt": "p"}},
        {"key": "f:0:1", "retryable": False, "attempt": 1, "request": None},
    ]
    log.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"key": "torn', encoding="utf-8")
    cfg = load_config(tmp_path / "configs" / "batch.yaml")
    r = plan_retry(cfg, log, include_all=False)
    assert (r.resubmitted, r.out_of_attempts, r.not_retryable) == (0, 1, 2)
    r = plan_retry(cfg, log, include_all=True)
    assert (r.resubmitted, r.out_of_attempts, r.no_request) == (1, 1, 1)


def test_same_input_name_twice_never_overwrites_earlier_results(tmp_path: Path) -> None:
    drop(tmp_path, "daily.txt", "first\n")
    serve(tmp_path)
    drop(tmp_path, "daily.txt", "second\n")
    serve(tmp_path)
    out = outputs(tmp_path)
    assert out["daily.txt.results.jsonl"][0]["response"]["body"]["text"] == "tsrif"
    [again] = [name for name in out if name.startswith("daily~")]  # daily~<claim number>.txt
    assert out[again][0]["response"]["body"]["text"] == "dnoces"


def test_status_reports_counts_lock_and_heartbeat(tmp_path: Path) -> None:
    drop(tmp_path, "a.txt", "x\n")
    serve(tmp_path)
    drop(tmp_path, "b.txt", "y\n", age_s=100)
    info = status(load_config(tmp_path / "configs" / "batch.yaml"))
    assert info["counts"]["pending"] == 1 and info["counts"]["processed"] == 1
    assert info["counts"]["outputs"] == 1 and info["lock_holder"] is None
    assert info["oldest_pending_age_s"] >= 99 and info["heartbeat"]["state"] == "stopped"


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"batch_sise": 3}, "batch_sise: unknown key"),
        ({"batch_size": "many"}, "batch_size: must be int"),
        ({"batch_size": 0}, "batch_size: must be positive"),
        ({"folders": {"inputs": 3}}, "folders.inputs: must be str"),
        ({"output_formats": ["pdf"]}, "output_formats:"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, patch: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(make_queue(tmp_path, **patch))


def test_shipped_config_is_valid() -> None:
    cfg = load_config(Path(__file__).parents[1] / "configs" / "batch.yaml")
    assert cfg.folders.inputs.name == "batch_inputs" and cfg.batch_size > 0


def test_retry_command_reports_queues_once_and_rejects_a_missing_log(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from celeris_cli.cli import app

    config = make_queue(tmp_path)
    log = tmp_path / "logs" / "failed.jsonl"
    rec = {"key": "f:1:1", "retryable": True, "attempt": 1, "request": {"custom_id": "a", "prompt": "p"}}
    log.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    runner = CliRunner()
    args = ["retry", str(log), "--config", str(config), "--no-run", "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["resubmitted"] == 1
    second = runner.invoke(app, args)
    assert json.loads(second.stdout)["resubmitted"] == 0 and json.loads(second.stdout)["already_retried"] == 1
    assert len(list((tmp_path / "batch_inputs").glob("retry-*.jsonl"))) == 1
    missing = runner.invoke(app, ["retry", str(tmp_path / "nope.jsonl"), "--config", str(config)])
    assert missing.exit_code != 0 and "failure log not found" in missing.output


def test_status_command_prints_a_table_and_rejects_a_bad_config(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from celeris_cli.cli import app

    drop(tmp_path, "a.txt", "x\n")
    serve(tmp_path)
    drop(tmp_path, "b.txt", "y\n")
    runner = CliRunner()
    shown = runner.invoke(app, ["status", str(tmp_path / "configs" / "batch.yaml")], terminal_width=120)
    assert shown.exit_code == 0, shown.output
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in shown.stdout.splitlines()
        if line.count("│") == 3
    }
    assert rows["pending"] == "1" and rows["processed"] == "1" and rows["lock holder"] == "-"
    assert rows["last heartbeat"].startswith("stopped")
    bad = runner.invoke(app, ["status", str(tmp_path / "missing.yaml")])
    assert bad.exit_code != 0 and "missing.yaml" in bad.output and "Traceback" not in bad.output
