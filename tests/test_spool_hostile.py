"""Hostile faults the queue must survive in-process: short writes, names it did not expect, folders
deleted under it, lines appended after a claim. Subprocess cases are in test_spool_hostile_process.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celeris_cli.errors import EXIT_IO
from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool
from celeris_cli.spool.intake import Inbox, Job
from celeris_cli.spool.ledger import EventLog

from .spool_helpers import FakeBackend, claimed, drop, failures, make_queue, outputs, visible


def put(root: Path, name: str, content: str, age_s: float) -> None:
    """Write an inbox file in place (a name too long for `drop`'s `.name.part`), aged with os.utime."""
    path = root / "batch_inputs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8")
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def serve(root: Path, backend: FakeBackend | None = None, **cfg: Any) -> int:
    backend = backend or FakeBackend()
    return Spool(load_config(make_queue(root, **cfg)), lambda: backend).run(once=True)


BAD = "".join(json.dumps({"id": f"b{i}", "prompt": "x" * 2000, "temperature": "hot"}) + "\n" for i in range(3))


def short_writes(monkeypatch: pytest.MonkeyPatch, then_enospc: bool) -> dict[str, int]:
    """os.write writes half of a failure record and returns the short count without raising (as a
    filling tmpfs does); with `then_enospc`, the next write of that record raises ENOSPC."""
    real = os.write
    state = {"short": 0}

    def write(fd: int, data: Any) -> int:
        if b'"key"' in bytes(data[:200]) and b'"code"' in bytes(data):
            if state["short"] == 0:
                state["short"] = 1
                return real(fd, bytes(data)[: len(data) // 2])
            if then_enospc and state["short"] == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return state


def test_a_short_write_of_a_failure_record_is_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drop(tmp_path, "late.jsonl", BAD)
    short_writes(monkeypatch, then_enospc=False)
    assert serve(tmp_path) == 1
    recs = failures(tmp_path)
    assert sorted(r["custom_id"] for r in recs) == ["b0", "b1", "b2"]
    assert all(line.startswith("{") for line in (tmp_path / "logs" / "failed.jsonl").read_text().splitlines())


def test_a_write_that_runs_out_of_space_leaves_no_torn_record_and_is_written_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drop(tmp_path, "late.jsonl", BAD)
    short_writes(monkeypatch, then_enospc=True)
    assert serve(tmp_path, publish_retry_s=0.05) == EXIT_IO  # publish blocked: the file stays claimed
    text = (tmp_path / "logs" / "failed.jsonl").read_text() if (tmp_path / "logs" / "failed.jsonl").exists() else ""
    assert text == "" or text.endswith("\n")  # complete records or none
    monkeypatch.undo()
    assert serve(tmp_path) == 1
    assert sorted(r["custom_id"] for r in failures(tmp_path)) == ["b0", "b1", "b2"]
    assert len((tmp_path / "logs" / "failed.jsonl").read_text().splitlines()) == 3


def test_a_torn_tail_left_by_a_crash_is_repaired_before_the_next_append(tmp_path: Path) -> None:
    from celeris_cli.spool.fsutil import append_line

    log = tmp_path / "failed.jsonl"
    log.write_bytes(b'{"key": "a"}\n{"key": "b", "sou')
    append_line(log, '{"key": "c"}')
    assert log.read_bytes() == b'{"key": "a"}\n{"key": "c"}\n'


@pytest.fixture
def small_logs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """`logs/` on a real tmpfs that is full but for two pages (root only; skipped elsewhere)."""
    yield from tmpfs_logs(tmp_path, free_pages=2)


@pytest.fixture
def full_logs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """`logs/` on a real tmpfs with no free page at all (root only; skipped elsewhere)."""
    yield from tmpfs_logs(tmp_path, free_pages=0)


def tmpfs_logs(tmp_path: Path, free_pages: int) -> Iterator[Path]:
    # the lock's and heartbeat's pages are taken before the disk fills, and the event log's first page is
    # full: of two pages left, the event log takes one and the failure log the other
    pad = json.dumps({"event": "pad", "pad": "." * 4068}) + "\n"
    before = {".celeris.lock": "pid 0\n", "heartbeat.json": "{}", "events.jsonl": pad}
    yield from tmpfs_at(tmp_path / "logs", free_pages, lambda logs: write_files(logs, before))


def write_files(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def tmpfs_at(folder: Path, free_pages: int, setup: Callable[[Path], object]) -> Iterator[Path]:
    """`folder` on a real tmpfs, `setup` run on it, then filled up but for
    `free_pages`. Yields the filler file (a dot-file, which the queue ignores); unlink it to make room."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        setup(folder)
        filler = folder / ".filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096) == 4096:
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        os.truncate(filler, max(0, filler.stat().st_size - 4096 * free_pages))
        yield filler
    finally:
        subprocess.run(["umount", "-l", str(folder)])


def test_a_really_full_tmpfs_under_logs_tears_no_record(tmp_path: Path, small_logs: Path) -> None:
    big = "".join(json.dumps({"id": f"b{i}", "prompt": "y" * 5000, "temperature": "hot"}) + "\n" for i in range(3))
    drop(tmp_path, "late.jsonl", big)
    assert serve(tmp_path, publish_retry_s=0.05) == EXIT_IO
    log = tmp_path / "logs" / "failed.jsonl"
    assert all(json.loads(line) for line in (log.read_text().splitlines() if log.exists() else []))
    small_logs.unlink()
    assert serve(tmp_path) == 1
    lines = log.read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in lines) == ["b0", "b1", "b2"]


def test_a_250_byte_name_is_served_under_a_short_readable_name_and_stops_nothing(tmp_path: Path) -> None:
    names = ["é" * 120 + "abcd.jsonl", "x" * 245 + ".txt", "y" * 251 + ".txt"]  # 254, 249 and 255 bytes
    for i, name in enumerate(names):
        put(tmp_path, name, json.dumps({"id": "a", "prompt": f"long {i}"}) + "\n", age_s=30 - i)
    drop(tmp_path, "plain.txt", "beside it\n", age_s=5)
    assert serve(tmp_path) == 0
    out = outputs(tmp_path)
    assert len(out) == 4 and out["plain.txt.results.jsonl"][0]["response"]["body"]["text"] == "ti ediseb"
    for name in out:
        assert len(os.fsencode(name)) <= 255
    long_ones = sorted(n for n in out if n != "plain.txt.results.jsonl")
    assert [n[:3] for n in long_ones] == ["xxx", "yyy", "ééé"]  # the readable stem kept
    assert all(n.endswith((".jsonl.results.jsonl", ".txt.results.jsonl")) for n in long_ones)
    assert [n for n in os.listdir(tmp_path / "batch_inputs") if not n.startswith(".")] == []


def test_odd_legal_names_are_served_or_quarantined_with_a_record(tmp_path: Path) -> None:
    drop(tmp_path, "new\nline.txt", "one\n", age_s=30)
    drop(tmp_path, os.fsdecode(b"latin\xe9.txt"), "two\n", age_s=29)
    drop(tmp_path, "tab\there -- .jsonl", json.dumps({"id": "t", "prompt": "three"}) + "\n", age_s=28)
    drop(tmp_path, "no-suffix", "four\n", age_s=27)
    drop(tmp_path, "plain.txt", "five\n", age_s=5)
    assert serve(tmp_path) == 1  # the one without a known suffix is quarantined with a record
    out = outputs(tmp_path)
    assert len(out) == 4 and "new\nline.txt.results.jsonl" in out
    [rec] = failures(tmp_path)
    assert rec["source"]["file"] == "no-suffix" and rec["code"] == "unsupported_format", rec


def test_a_derived_name_never_takes_a_name_a_user_wrote(tmp_path: Path) -> None:
    from celeris_cli.spool.intake import SEQ_BLOCK

    user = f"dup~{SEQ_BLOCK + 1}.jsonl"  # the name the second run would give a second dup.jsonl
    drop(tmp_path, "dup.jsonl", json.dumps({"id": "a", "prompt": "first"}) + "\n", age_s=20)
    drop(tmp_path, user, json.dumps({"id": "a", "prompt": "users own"}) + "\n", age_s=10)
    assert serve(tmp_path) == 0
    drop(tmp_path, "dup.jsonl", json.dumps({"id": "a", "prompt": "second"}) + "\n")
    assert serve(tmp_path) == 0
    texts = sorted(r["response"]["body"]["text"] for recs in outputs(tmp_path).values() for r in recs)
    assert texts == sorted(["tsrif", "nwo sresu", "dnoces"])
    assert outputs(tmp_path)[f"{user}.results.jsonl"][0]["response"]["body"]["text"] == "nwo sresu"


def test_a_claim_name_with_a_newline_is_resumed_as_itself(tmp_path: Path) -> None:
    from celeris_cli.spool.intake import Inbox

    cfg = load_config(make_queue(tmp_path))
    work = tmp_path / "batch_inputs" / ".work"
    work.mkdir()
    (work / "00000007.new\nline.txt").write_text("left claimed\n")
    [job] = Inbox(cfg.folders, 0.2, EventLog(tmp_path / "logs" / "events.jsonl")).open(0)
    assert (job.seq, job.name) == (7, "new\nline.txt")
    assert os.listdir(work) == ["00000007.new\nline.txt"]


def lines(first: int, last: int) -> str:
    return "".join(json.dumps({"id": f"r{i}", "prompt": f"p{i}"}) + "\n" for i in range(first, last + 1))


class WritesDuringBatch(FakeBackend):
    """The producer goes on writing through its open handle while the first batch decodes: a pause
    shorter than settle_s."""

    def __init__(self, handle: Any, text: str) -> None:
        super().__init__()
        self.handle, self.text = handle, text

    def run(self, batch: list[Any]) -> list[dict[str, Any]]:
        if self.text:
            self.handle.write(self.text)
            self.handle.flush()
            self.text = ""
        return super().run(batch)


def test_lines_written_within_settle_after_the_claim_are_served(tmp_path: Path) -> None:
    make_queue(tmp_path)
    path = tmp_path / "batch_inputs" / "slow.jsonl"
    with open(path, "w") as handle:
        handle.write(lines(1, 8))
        handle.flush()
        os.utime(path, (time.time() - 10, time.time() - 10))  # settled: claimed at once
        assert serve(tmp_path, backend=WritesDuringBatch(handle, lines(9, 17))) == 0
    assert [r["custom_id"] for r in outputs(tmp_path)["slow.jsonl.results.jsonl"]] == [f"r{i}" for i in range(1, 18)]
    assert failures(tmp_path) == []


def test_lines_written_after_the_publish_get_changed_after_claim_records_and_retry_serves_them(
    tmp_path: Path,
) -> None:
    from celeris_cli.spool.ops import plan_retry

    config = make_queue(tmp_path)
    path = tmp_path / "batch_inputs" / "slow.jsonl"
    with open(path, "w") as handle:
        handle.write(lines(1, 8))
        handle.flush()
        os.utime(path, (time.time() - 10, time.time() - 10))
        assert serve(tmp_path) == 0  # published: the producer paused longer than settle_s
        handle.write(lines(9, 17))  # ... and goes on, into what is now batch_processed/slow.jsonl
    assert serve(tmp_path) == 1
    recs = failures(tmp_path)
    assert sorted(r["source"]["line"] for r in recs) == list(range(9, 18))
    assert {r["code"] for r in recs} == {"changed_after_claim"} and all(r["retryable"] for r in recs)
    assert serve(tmp_path) == 0 and len(failures(tmp_path)) == 9  # recorded once
    report = plan_retry(load_config(config), tmp_path / "logs" / "failed.jsonl", include_all=False)
    assert report.resubmitted == 9
    assert serve(tmp_path) == 0
    served = sorted(r["custom_id"] for recs in outputs(tmp_path).values() for r in recs)
    assert served == sorted(f"r{i}" for i in range(1, 18))


def test_late_window_s_bounds_how_long_a_published_file_is_watched(tmp_path: Path) -> None:
    """With no window, a line appended after the publish is not watched for (no record); with one, it is."""
    for window, records in ((0, 0), (600, 1)):
        root = tmp_path / str(window)
        make_queue(root, late_window_s=window)
        path = root / "batch_inputs" / "slow.jsonl"
        with open(path, "w") as handle:
            handle.write(lines(1, 2))
            handle.flush()
            os.utime(path, (time.time() - 10, time.time() - 10))
            assert serve(root, late_window_s=window) == 0
            handle.write(lines(3, 3))
        serve(root, late_window_s=window)
        assert len(failures(root)) == records, window


def test_a_last_line_read_without_its_newline_is_never_served_twice(tmp_path: Path) -> None:
    from celeris_cli.spool.reading import Snapshot, read_claimed

    path = tmp_path / "f.txt"
    path.write_bytes(b"a\nb\nc")
    first = read_claimed(path, "f.txt", Snapshot(), settle_s=0, max_line_bytes=100)
    assert [r.prompt for r in first.requests] == ["a", "b", "c"]
    path.write_bytes(b"a\nb\ncd\ne\n")
    again = read_claimed(path, "f.txt", first.snapshot, settle_s=0, max_line_bytes=100)
    assert [r.prompt for r in again.requests] == ["e"] and again.changed == [3]
    assert read_claimed(path, "f.txt", again.snapshot, settle_s=0, max_line_bytes=100).requests == []


def test_two_claims_left_with_one_name_are_published_under_two_names(tmp_path: Path) -> None:
    make_queue(tmp_path)
    work = tmp_path / "batch_inputs" / ".work"
    work.mkdir(parents=True)
    (work / "00000033.dup~66.jsonl").write_text(json.dumps({"id": "a", "prompt": "one"}) + "\n")
    (work / "00000066.dup~66.jsonl").write_text(json.dumps({"id": "a", "prompt": "two"}) + "\n")
    (work / ("L" * 250 + ".txt")).write_text("an older layout's long name\n")  # no claim number
    assert serve(tmp_path) == 0
    texts = sorted(r["response"]["body"]["text"] for recs in outputs(tmp_path).values() for r in recs)
    assert texts == sorted(["eno", "owt", "eman gnol s'tuoyal redlo na"])


@pytest.mark.parametrize("folder", ["batch_outputs", "batch_processed", "logs"])
def test_a_folder_deleted_in_the_middle_of_a_publish_delays_it_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    import shutil

    from celeris_cli.spool import finish

    real = finish.sync_folder
    state = {"deleted": False}

    def sync_then_delete(where: Path, files: list[Path]) -> None:
        real(where, files)
        if not state["deleted"]:  # between the results' temp files and their rename
            state["deleted"] = True
            shutil.rmtree(tmp_path / folder)

    monkeypatch.setattr(finish, "sync_folder", sync_then_delete)
    drop(tmp_path, "a.jsonl", json.dumps({"id": "a", "prompt": "kept"}) + "\n{broken\n")
    assert serve(tmp_path, publish_retry_s=0.01) == 1
    assert outputs(tmp_path)["a.jsonl.results.jsonl"][0]["response"]["body"]["text"] == "tpek"
    assert [r["code"] for r in failures(tmp_path)] == ["invalid_json"]
    assert (tmp_path / "batch_processed" / "a.jsonl").exists()


def test_a_file_to_quarantine_on_a_full_disk_waits_and_is_quarantined_once_there_is_room(
    tmp_path: Path, full_logs: Path
) -> None:
    (tmp_path / "batch_inputs").mkdir()
    os.symlink("/etc/hostname", tmp_path / "batch_inputs" / "link.jsonl")  # quarantined: never followed
    assert serve(tmp_path, publish_retry_s=0.05) == EXIT_IO  # its record cannot be written: it stays claimed
    assert len(claimed(tmp_path)) == 1 and not visible(tmp_path / "batch_processed")
    full_logs.unlink()
    assert serve(tmp_path) == 1  # a restart quarantines it, with its one record
    assert [r["code"] for r in failures(tmp_path)] == ["symlink"]
    assert claimed(tmp_path) == [] and os.path.islink(tmp_path / "batch_processed" / "quarantine" / "link.jsonl")


def test_a_claimed_file_deleted_before_it_is_read_is_dropped_not_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user deletes the inbox, with its work folder, between the claim and the read."""
    drop(tmp_path, "a.jsonl", json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    real = Inbox.claim

    def claim_then_delete(self: Inbox, path: Path) -> Job | None:
        job = real(self, path)
        shutil.rmtree(tmp_path / "batch_inputs")
        return job

    monkeypatch.setattr(Inbox, "claim", claim_then_delete)
    assert serve(tmp_path) == 0
    assert failures(tmp_path) == [] and outputs(tmp_path) == {}
    assert [e["file"] for e in events(tmp_path, "gone")] == ["a.jsonl"]
    monkeypatch.undo()
    drop(tmp_path, "b.jsonl", json.dumps({"id": "b", "prompt": "hi"}) + "\n")
    assert serve(tmp_path) == 0 and list(outputs(tmp_path)) == ["b.jsonl.results.jsonl"]


def events(root: Path, kind: str) -> list[dict[str, Any]]:
    lines = (root / "logs" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def test_late_lines_that_cannot_be_recorded_on_a_full_disk_are_recorded_once_there_is_room(
    tmp_path: Path, full_logs: Path
) -> None:
    path = tmp_path / "batch_inputs" / "slow.jsonl"
    path.parent.mkdir()
    with open(path, "w") as handle:
        handle.write(lines(1, 8))
        handle.flush()
        os.utime(path, (time.time() - 10, time.time() - 10))
        assert serve(tmp_path) == 0  # published, with no failure record to write
        handle.write(lines(9, 17))  # late, into batch_processed/slow.jsonl, whose records find no room
    serve(tmp_path)
    assert failures(tmp_path) == []
    full_logs.unlink()
    assert serve(tmp_path) == 1
    assert sorted(r["source"]["line"] for r in failures(tmp_path)) == list(range(9, 18))


class WritesDuringBatches(FakeBackend):
    """The producer acts on its open handle while each batch decodes: one action per batch."""

    def __init__(self, handle: Any, actions: list[Any]) -> None:
        super().__init__()
        self.handle, self.actions = handle, actions

    def run(self, batch: list[Any]) -> list[dict[str, Any]]:
        if self.actions:
            self.actions.pop(0)(self.handle)
            self.handle.flush()
        return super().run(batch)


def test_a_changed_line_and_a_rewrite_of_one_claim_get_a_record_each(tmp_path: Path) -> None:
    make_queue(tmp_path)
    path = tmp_path / "batch_inputs" / "f.txt"
    path.write_bytes(b"a\nb\nc")  # settled: its last line is read without a newline

    def rewrite(h: Any) -> None:
        h.seek(0)
        h.truncate()
        h.write("zzz\n")

    with open(path, "a") as handle:
        os.utime(path, (time.time() - 10, time.time() - 10))
        backend = WritesDuringBatches(handle, [lambda h: h.write("d\ne\n"), rewrite])
        assert serve(tmp_path, backend=backend) == 1
    recs = failures(tmp_path)
    assert sorted((r["source"]["line"], r["code"]) for r in recs) == [
        (0, "changed_after_claim"),
        (3, "changed_after_claim"),
    ]
    assert len({r["key"] for r in recs}) == 2


def test_bytes_appended_after_the_settle_check_are_not_read_as_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celeris_cli.spool import reading

    path = tmp_path / "f.txt"
    path.write_bytes(b"a\n")
    os.utime(path, (time.time() - 10, time.time() - 10))
    real = os.lstat

    def lstat_then_append(p: Any) -> os.stat_result:
        st = real(p)
        with open(p, "ab") as f:  # the writer goes on between the stat and the read
            f.write(b"hal")
        return st

    monkeypatch.setattr(reading.os, "lstat", lstat_then_append)
    got = reading.read_claimed(path, "f.txt", reading.Snapshot(), settle_s=5, max_line_bytes=100)
    monkeypatch.undo()
    assert [r.prompt for r in got.requests] == ["a"] and got.snapshot.tail == b""


def test_a_young_file_without_a_whole_line_yields_nothing_yet(tmp_path: Path) -> None:
    from celeris_cli.spool.reading import Snapshot, read_claimed

    path = tmp_path / "f.txt"
    path.write_bytes(b"hal")  # its writer is mid-line
    got = read_claimed(path, "f.txt", Snapshot(), settle_s=5, max_line_bytes=100)
    assert got.requests == [] and got.snapshot == Snapshot()
    path.write_bytes(b"half\n")
    assert [r.prompt for r in read_claimed(path, "f.txt", got.snapshot, settle_s=5, max_line_bytes=100).requests] == [
        "half"
    ]


@pytest.fixture
def full_queue(tmp_path: Path) -> Iterator[Path]:
    """A whole queue on a full tmpfs, its inbox holding one request file."""

    def setup(root: Path) -> None:
        make_queue(root)
        locks = {f"{d}/.celeris.lock": "pid 0\n" for d in ("batch_inputs", "batch_outputs", "batch_processed", "logs")}
        write_files(root, {**locks, "batch_inputs/a.jsonl": json.dumps({"id": "a", "prompt": "hi"}) + "\n"})

    yield from tmpfs_at(tmp_path, 0, setup)


def test_once_exits_74_while_a_claim_is_refused_and_serves_the_file_once_there_is_room(
    tmp_path: Path, full_queue: Path
) -> None:
    inbox = tmp_path / "batch_inputs"
    os.utime(inbox / "a.jsonl", (time.time() - 10, time.time() - 10))
    assert serve(tmp_path) == EXIT_IO  # the claim counter cannot be written: the file is stuck
    assert visible(inbox) == ["a.jsonl"] and outputs(tmp_path) == {}
    full_queue.unlink()
    assert serve(tmp_path) == 0 and list(outputs(tmp_path)) == ["a.jsonl.results.jsonl"]


def test_a_refused_name_is_forgotten_once_its_wait_is_over_or_it_is_gone(tmp_path: Path) -> None:
    cfg = load_config(make_queue(tmp_path))
    inbox = Inbox(cfg.folders, 0.2, EventLog(tmp_path / "logs" / "events.jsonl"))
    drop(tmp_path, "kept.jsonl", "x\n")
    inbox.refuse("kept.jsonl")
    inbox.refuse("gone.jsonl")
    inbox.refused["old.jsonl"] = time.time() - 1
    assert inbox.scan() == ([], 0)
    assert list(inbox.refused) == ["kept.jsonl"]
