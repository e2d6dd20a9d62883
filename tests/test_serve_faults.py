"""A fault matrix for the server's Batch API, through the real `openai` client and raw HTTP on loopback:
keys that are not tenants of each other's files, oversized and malformed uploads, a full disk, a cancel
while the queue decodes, retries of failed lines, a restart over a batch the queue answered, and a
journal that repeats outcomes. The app runs in-process (`serve_inproc`), the queue's moves by hand; the
kills of real processes are in test_serve_batch.py."""

from __future__ import annotations

import errno
import http.client
import io
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from celeris_cli.serve.batch_format import journal_counts
from celeris_cli.serve.batches import BatchStore
from celeris_cli.serve.private import key_file_warning
from celeris_cli.spool.config import load_config

from .serve_helpers import ENV, free_port
from .serve_inproc import App, batch_line

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"


@pytest.fixture()
def app(tmp_path: Path) -> Iterator[App]:
    a = App(tmp_path, max_file_bytes=30_000, max_batch_lines=500).start()
    yield a
    a.stop()


@pytest.fixture()
def keyed(tmp_path: Path) -> Iterator[App]:
    a = App(tmp_path, keys=(KEY_A, KEY_B)).start()
    yield a
    a.stop()


def upload(client: Any, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return str(client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id)


def start_batch(client: Any, lines: list[str]) -> Any:
    return client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
    )


# -- keys (row 5) ----------------------------------------------------------------------------------
def test_a_key_sees_only_its_own_files_and_batches(keyed: App) -> None:
    a, b = keyed.client(KEY_A), keyed.client(KEY_B)
    batch = start_batch(a, [batch_line("a0")])
    file_id = batch.input_file_id
    assert [f.id for f in b.files.list()] == [] and [x.id for x in b.batches.list()] == []
    for call in (
        lambda: b.files.retrieve(file_id),
        lambda: b.files.content(file_id),
        lambda: b.files.delete(file_id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [f.id for f in a.files.list()] == [file_id] and a.batches.retrieve(batch.id).id == batch.id
    stored = json.loads((keyed.root / "serve" / "files" / f"{file_id}.json").read_text())
    assert KEY_A not in json.dumps(stored) and stored["owner"]  # a hash of the key, never the key


# -- state files (row 6) ---------------------------------------------------------------------------
def test_uploads_outputs_and_records_are_private(app: App) -> None:
    old = os.umask(0o022)  # the usual umask, which would leave them 0644
    try:
        client = app.client()
        batch = start_batch(client, [batch_line("p0"), batch_line("p1")])
        d = app.daemon
        d.publish(d.claim(d.pending(batch.id)[0]))
        app.batches.advance(batch.id)
        done = client.batches.retrieve(batch.id)
    finally:
        os.umask(old)
    assert done.status == "completed" and done.output_file_id
    serve = app.root / "serve"
    for folder in (serve / "files", serve / "batches"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        for path in folder.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_key_file_others_can_read_is_warned_about_at_startup(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY_A + "\n")
    keys.chmod(0o600)
    assert key_file_warning(keys) is None
    keys.chmod(0o644)
    assert "0644" in (key_file_warning(keys) or "")
    taken = free_port()
    import socket

    with socket.socket() as s:  # the port taken: serve stops right after reading the keys, before any model
        s.bind(("127.0.0.1", taken))
        s.listen()
        cmd = [sys.executable, "-m", "celeris_cli", "serve", "--port", str(taken), "--api-key-file", str(keys)]
        run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "other users may read the keys" in run.stderr and KEY_A not in run.stderr


# -- uploads (row 9) -------------------------------------------------------------------------------
def _multipart(content: bytes) -> tuple[bytes, str]:
    boundary = "celerisboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    return head + content + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _chunked_post(app: App, body: bytes, content_type: str) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=30)
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))
    conn.request("POST", "/v1/files", body=chunks, headers={"Content-Type": content_type}, encode_chunked=True)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_a_chunked_upload_over_the_limit_is_413_like_one_with_a_length(app: App) -> None:
    status, err = _chunked_post(app, *_multipart(b"x" * 40_000))
    assert status == 413 and err["error"]["code"] == "request_too_large" and "30000" in err["error"]["message"]
    status, ok = _chunked_post(app, *_multipart((batch_line("c0") + "\n").encode()))
    assert status == 200 and ok["object"] == "file"
    with pytest.raises(openai.APIStatusError) as e:
        app.client().files.create(file=("big.jsonl", io.BytesIO(b"x" * 40_000)), purpose="batch")
    assert e.value.status_code == 413
    assert list((app.root / "serve" / "files").glob("*.tmp")) == []  # no half-written file stays


def test_a_malformed_upload_is_400_naming_what_is_missing(app: App) -> None:
    body, _ = _multipart(b"{}\n")
    status, err = _chunked_post(app, body.replace(b'name="file"', b'name="other"'), _multipart(b"")[1])
    assert status == 400 and err["error"]["param"] == "file"
    status, err = _chunked_post(app, b"not a form", "multipart/form-data; boundary=zz")
    assert status == 400 and "multipart" in err["error"]["message"]


# -- listing files (row 10) ------------------------------------------------------------------------
def test_files_list_pages_and_a_for_loop_over_it_ends(app: App) -> None:
    client = app.client()
    ids = {upload(client, [batch_line(f"l{i}")]) for i in range(5)}
    assert {f.id for f in client.files.list()} == ids  # ends: has_more is false on the last page
    page = client.files.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    assert {f.id for f in client.files.list(limit=2)} == ids  # the client follows `after` page by page
    seen = [f.id for f in client.files.list(limit=2, order="asc")]
    assert len(seen) == 5 and set(seen) == ids


# -- a full disk (row 14) --------------------------------------------------------------------------
def _no_space(*_: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_on_a_full_disk_status_reads_answer_and_uploads_are_507(app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    client = app.client()
    batch = start_batch(client, [batch_line("d0"), batch_line("d1")])
    monkeypatch.setattr(os, "fsync", _no_space)  # every durable write now fails, as on a full disk
    d = app.daemon
    claimed = d.claim(d.pending(batch.id)[0])
    d.journal(claimed, [{"line": 1, "body": {"text": "t"}}])
    for _ in range(5):
        got = client.batches.retrieve(batch.id)
        assert got.status == "in_progress" and got.request_counts.completed == 1  # type: ignore[union-attr]
    d.publish(claimed)
    assert client.batches.retrieve(batch.id).status == "finalizing"
    assert [b.id for b in client.batches.list()] == [batch.id]
    with pytest.raises(openai.APIStatusError) as e:
        upload(client, [batch_line("d2")])
    assert e.value.status_code == 507 and "disk" in e.value.message and "serve" in e.value.message
    assert list((app.root / "serve" / "files").glob(".*.tmp")) == []
    with pytest.raises(openai.APIStatusError) as e:
        client.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.status_code == 507
    monkeypatch.undo()
    app.batches.advance(batch.id)  # room again: the follower writes the output
    assert client.batches.retrieve(batch.id).status == "completed"


# -- cancel (row 13) -------------------------------------------------------------------------------
def test_a_cancel_drops_the_lines_not_decoding_and_keeps_what_the_queue_answered(app: App) -> None:
    """160 lines, batch_size 16: parts of 32, two in the queue at a time. Cancelled while the first is
    decoding (16 answered): the second leaves the inbox, the other three are never published, and the
    batch is `cancelled` with the first part's 32 answers as soon as the queue has published it."""
    client = app.client()
    batch = start_batch(client, [batch_line(f"r{i}") for i in range(160)])
    d = app.daemon
    parts = d.pending(batch.id)
    assert len(parts) == 2  # OUTSTANDING
    claimed = d.claim(parts[0])
    d.journal(claimed, [{"line": n, "body": {"text": "t"}} for n in range(1, 17)])
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.request_counts.completed == 16  # type: ignore[union-attr]
    assert d.pending(batch.id) == []  # the part not claimed yet was taken out
    app.batches.advance(batch.id)
    assert d.pending(batch.id) == [] and client.batches.retrieve(batch.id).status == "cancelling"
    d.publish(claimed)
    app.batches.advance(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts.model_dump() == {"total": 160, "completed": 32, "failed": 0}  # type: ignore[union-attr]
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(32)]
    assert sorted(p.name for p in (app.root / "batch_processed").iterdir() if p.is_file()) == [claimed.name[9:]]


def test_parts_go_to_the_queue_as_parts_finish_and_answer_in_input_order(app: App) -> None:
    client = app.client()
    lines = [batch_line(f"o{i}") for i in range(100)]
    lines[40] = batch_line(None)  # no custom_id: the queue's `line-N`, N in the whole file
    batch = start_batch(client, lines)
    d = app.daemon
    for _ in range(4):  # 32 + 32 + 32 + 4
        app.batches.advance(batch.id)
        (name,) = d.pending(batch.id)[:1]
        d.publish(d.claim(name), fail=(3,) if name.endswith(".0001.jsonl") else (), code="poison")
    app.batches.advance(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 100, "completed": 99, "failed": 1}  # type: ignore[union-attr]
    out = [json.loads(x)["custom_id"] for x in client.files.content(done.output_file_id).text.splitlines()]
    expected = [f"o{i}" for i in range(100)]
    expected[40] = "line-41"
    assert out == expected[:34] + expected[35:]
    (err,) = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert err["custom_id"] == "o34" and err["error"]["code"] == "poison"


def test_a_part_is_published_settled_so_the_queue_claims_it_at_once(app: App) -> None:
    """A part appears whole (a rename): it must not wait out the queue's settle time, or a fast device
    would idle between parts."""
    batch = start_batch(app.client(), [batch_line(f"s{i}") for i in range(40)])
    settle_s = load_config(app.config).settle_s
    for name in app.daemon.pending(batch.id):
        assert time.time() - (app.daemon.inbox / name).stat().st_mtime >= settle_s


# -- retry of failed lines (row 12) ----------------------------------------------------------------
def test_the_failed_lines_of_a_batch_are_retried_as_a_new_batch(app: App) -> None:
    client = app.client()
    lines = [batch_line(f"t{i}") for i in range(6)]
    lines[4] = batch_line(None)
    batch = start_batch(client, lines)
    d = app.daemon
    d.publish(d.claim(d.pending(batch.id)[0]), fail=(2, 5))
    app.batches.advance(batch.id)
    with pytest.raises(openai.BadRequestError):
        client.post(f"/batches/{start_batch(client, lines[:1]).id}/retry", cast_to=openai.types.Batch)
    retry = client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch)
    assert retry.id != batch.id and retry.status == "validating" and retry.metadata == {"retry_of": batch.id}
    assert retry.request_counts.total == 2  # type: ignore[union-attr]
    (part,) = d.pending(retry.id)
    again = [json.loads(x) for x in (d.inbox / part).read_text().splitlines()]
    assert [x["custom_id"] for x in again] == ["t1", "line-5"] and again[0]["body"]["prompt"] == "x"
    with pytest.raises(openai.NotFoundError):
        client.post("/batches/batch_000000000000000000000000/retry", cast_to=openai.types.Batch)


# -- a restart over a batch the queue already answered (row 17) ------------------------------------
def test_a_restart_never_publishes_again_a_part_the_queue_answered(tmp_path: Path) -> None:
    app = App(tmp_path)  # not started: the store alone, as the server holds it
    store = app.batches
    meta = store.files.add_bytes((batch_line("v0") + "\n").encode(), "in.jsonl", "batch")
    batch = store.create(None, meta["id"], "/v1/completions", "24h", None)
    d = app.daemon
    (name,) = d.pending(batch["id"])
    d.publish(d.claim(name))  # the queue answered it while the server was down...
    (tmp_path / "batch_processed" / name).unlink()  # ...and its processed copy was cleaned away since
    again = BatchStore(store.folder, load_config(app.config), store.files, "m")
    again.recover()
    assert d.pending(batch["id"]) == []  # not run twice
    again.advance(batch["id"])
    got = again.get(batch["id"])
    assert got is not None and got["status"] == "completed" and got["request_counts"]["completed"] == 1


# -- a journal that repeats outcomes (row 19) ------------------------------------------------------
def test_counts_in_progress_are_by_line_however_often_the_journal_repeats_them(app: App) -> None:
    client = app.client()
    batch = start_batch(client, [batch_line(f"j{i}") for i in range(20)])
    d = app.daemon
    claimed = d.claim(d.pending(batch.id)[0])
    outcomes = [{"line": n, "body": {"text": "t"}} for n in range(1, 20)] + [{"line": 20, "failure": {}}]
    for _ in range(5):  # a publish blocked 5 times: the queue journals every outcome again each time
        d.journal(claimed, outcomes)
    got = client.batches.retrieve(batch.id)
    assert got.request_counts.model_dump() == {"total": 20, "completed": 19, "failed": 1}  # type: ignore[union-attr]
    journal = d.work / "journal" / f"{claimed.name.partition('.')[0]}.jsonl"
    assert journal_counts(journal) == (19, 1)
