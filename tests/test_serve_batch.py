"""The Batch API over the queue, with the real `openai` client against a real `celeris serve --queue`
and a real `celeris watch` on the same config: files, batches created, polled, downloaded and cancelled,
the limits on uploads, and a 200-line batch that survives SIGKILL of both the server and the daemon."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .serve_helpers import ENV, REPO, Server, Watch, celeris, wait_for
from .spool_helpers import make_queue

MODEL = "celeris-block"


class Queue:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = make_queue(root, model=Path(MODEL), generation={}, batch_size=16)  # an embedded name
        self.server = self._server().start()
        self.watch: Watch | None = None

    def _server(self) -> Server:
        limits = ("--max-file-bytes", "200000", "--max-batch-lines", "250")
        return Server("--queue", str(self.config), *limits, log=self.root / "serve.log")

    def start_watch(self) -> None:
        if self.watch is None or self.watch.proc is None or self.watch.proc.poll() is not None:
            self.watch = Watch(self.config, self.root / "watch.log").start()

    @property
    def client(self) -> openai.OpenAI:
        return self.server.client()  # type: ignore[no-any-return]

    def upload(self, lines: list[str]) -> str:
        data = ("\n".join(lines) + "\n").encode()
        return self.client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id

    def wait(self, batch_id: str, *status: str, timeout: float = 240) -> Any:
        return wait_for(
            lambda: (b := self.client.batches.retrieve(batch_id)).status in status and b, timeout=timeout, every=0.3
        )

    def lines(self, file_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queue]:
    q = Queue(tmp_path_factory.mktemp("queue"))
    yield q
    q.server.stop()
    if q.watch is not None:
        q.watch.stop()


def line(custom_id: str, prompt: str, seed: int, url: str = "/v1/completions", **body: Any) -> str:
    content = {"messages": [{"role": "user", "content": prompt}]} if "chat" in url else {"prompt": prompt}
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": url,
            "body": {**content, "max_tokens": 8, "seed": seed, **body},
        }
    )


PROMPTS = ["The quick", "床前明月光，", "Shall I compare", "白日依山尽，", "To be, or not"]


def test_a_batch_not_yet_claimed_is_cancelled_at_once(queue: Queue) -> None:
    """Before the daemon runs: the batch waits in the inbox (`validating`), and a cancel takes it out."""
    file_id = queue.upload([line(f"c{i}", p, i) for i, p in enumerate(PROMPTS[:3])])
    batch = queue.client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    assert batch.status == "validating" and (queue.root / "batch_inputs" / f"{batch.id}.0000.jsonl").exists()
    cancelled = queue.client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.total == 3  # type: ignore[union-attr]
    assert not (queue.root / "batch_inputs" / f"{batch.id}.0000.jsonl").exists()
    with pytest.raises(openai.BadRequestError):
        queue.client.batches.cancel(batch.id)


def test_a_batch_claimed_when_cancelled_ends_cancelled_with_what_it_answered(queue: Queue) -> None:
    """The queue cannot stop a claimed file: the batch is `cancelling` until the queue is done with it.
    Here the claim is one a daemon made just before it died; the daemon started next resumes it."""
    assert queue.watch is None, "runs before any daemon: the claim below is made by hand"
    file_id = queue.upload([line(f"k{i}", p, i) for i, p in enumerate(PROMPTS[:3])])
    batch = queue.client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    work = queue.root / "batch_inputs" / ".work"
    work.mkdir(exist_ok=True)
    part = f"{batch.id}.0000.jsonl"  # its one part (parts.py)
    os.rename(queue.root / "batch_inputs" / part, work / f"00000001.{part}")
    assert queue.client.batches.retrieve(batch.id).status == "in_progress"
    assert queue.client.batches.cancel(batch.id).status == "cancelling"
    queue.start_watch()
    done = queue.wait(batch.id, "cancelled")
    assert [x["custom_id"] for x in queue.lines(done.output_file_id)] == ["k0", "k1", "k2"]
    assert done.cancelled_at is not None and done.request_counts.completed == 3


def test_a_chat_batch_answers_in_chat_objects_and_lists_bad_lines_in_its_error_file(queue: Queue) -> None:
    url = "/v1/chat/completions"
    lines = [line(f"h{i}", p, i, url) for i, p in enumerate(PROMPTS)]
    lines.insert(2, line("h-bad", "x", 0, url, frobnicate=1))
    file_id = queue.upload(lines)
    queue.start_watch()
    batch = queue.client.batches.create(
        input_file_id=file_id, endpoint=url, completion_window="24h", metadata={"k": "v"}
    )
    done = queue.wait(batch.id, "completed", "failed")
    assert done.status == "completed" and done.metadata == {"k": "v"}
    assert done.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}  # type: ignore[union-attr]
    out = queue.lines(done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"h{i}" for i in range(5)]
    body = out[0]["response"]["body"]
    assert out[0]["error"] is None and out[0]["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    (err,) = queue.lines(done.error_file_id)
    assert err["custom_id"] == "h-bad" and err["response"] is None and "frobnicate" in err["error"]["message"]
    assert err["error"]["code"] == "bad_param"
    health = queue.server.get("/health")["queue"]  # the daemon beside the server, by its heartbeat
    assert queue.watch is not None and queue.watch.proc is not None
    assert health["daemon_pid"] == queue.watch.proc.pid and health["state"] in ("idle", "busy", "decoding")


def test_a_cancel_mid_batch_keeps_what_was_answered_and_never_decodes_the_rest(queue: Queue) -> None:
    """160 lines through the real daemon (batch_size 16: parts of 32, two in the queue at once), cancelled
    once the first answers are in: the lines not yet claimed are never decoded, the batch is `cancelled`
    soon, and its output holds exactly the answered lines, each once."""
    queue.start_watch()
    file_id = queue.upload([line(f"x{i}", PROMPTS[i % 5], i) for i in range(160)])
    batch = queue.client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: queue.client.batches.retrieve(batch.id).request_counts.completed > 0, every=0.2)  # type: ignore[union-attr]
    assert queue.client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = queue.wait(batch.id, "cancelled")
    answered = [x["custom_id"] for x in queue.lines(done.output_file_id)]
    assert 0 < len(answered) <= 64 and done.request_counts.completed == len(answered)  # type: ignore[union-attr]
    assert answered == [f"x{i}" for i in range(len(answered))]  # whole parts, in input order, each once
    assert not list((queue.root / "batch_inputs").glob(f"{batch.id}.*"))


def test_files_are_fetched_listed_and_deleted_by_opaque_id(queue: Queue) -> None:
    data = (line("f0", "The quick", 0) + "\n").encode()
    f = queue.client.files.create(file=("mine.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.filename == "mine.jsonl" and f.bytes == len(data) and f.purpose == "batch"
    assert queue.client.files.retrieve(f.id).id == f.id
    assert queue.client.files.content(f.id).content == data
    assert f.id in [x.id for x in queue.client.files.list().data]
    assert queue.client.files.delete(f.id).deleted
    for bad in (f.id, "file-..%2F..%2Fconfigs%2Fbatch.yaml", "..%2Fbatch.yaml"):
        with pytest.raises(openai.NotFoundError):
            queue.client.files.content(bad)


def test_uploads_and_batches_over_the_limits_are_refused(queue: Queue) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        queue.client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 200_001)), purpose="batch")
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as e:
        queue.upload([line(f"l{i}", "x", i) for i in range(251)])
    assert "250" in e.value.message
    with pytest.raises(openai.BadRequestError):
        queue.client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    file_id = queue.upload([line("u0", "x", 0, "/v1/chat/completions")])
    with pytest.raises(openai.BadRequestError) as e:
        queue.client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    assert "line 1" in e.value.message


def test_a_200_line_batch_survives_sigkill_of_the_server_and_its_daemon(queue: Queue, tmp_path: Path) -> None:
    good = [line(f"q{i}", f"{PROMPTS[i % 5]} {i}", i) for i in range(195)]
    bad = [
        "{not json",
        line("bad-param", "x", 0, frobnicate=1),
        json.dumps({"custom_id": "bad-missing", "method": "POST", "url": "/v1/completions", "body": {"max_tokens": 8}}),
        line("bad-n", "x", 0, n=2),
        line("bad-long", "word " * 600, 0),
    ]
    lines = good[:50] + bad[:2] + good[50:120] + bad[2:] + good[120:]
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    reference = subprocess.Popen(  # celeris batch on the same lines, meanwhile
        [sys.executable, "-m", "celeris_cli", "batch", "-i", str(source), "-o", str(tmp_path / "ref.jsonl")]
        + ["--model", MODEL, "--device", "cpu", "--dtype", "float32"],
        env=ENV,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    queue.start_watch()
    file_id = queue.upload(lines)
    batch = queue.client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    seen = wait_for(lambda: (b := queue.client.batches.retrieve(batch.id)).request_counts.completed > 0 and b)  # type: ignore[union-attr]
    assert seen.status == "in_progress" and seen.request_counts.completed < 195
    queue.server.kill()
    assert queue.watch is not None
    queue.watch.kill()

    queue.server = queue._server().start()
    queue.start_watch()
    done = queue.wait(batch.id, "completed", "failed")
    assert done.id == batch.id and done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 200, "completed": 195, "failed": 5}  # type: ignore[union-attr]
    out = queue.lines(done.output_file_id)
    errors = queue.lines(done.error_file_id)
    assert [x["custom_id"] for x in out] == [f"q{i}" for i in range(195)]  # each once, in input order
    assert sorted(str(x["custom_id"]) for x in errors) == ["bad-long", "bad-missing", "bad-n", "bad-param", "line-51"]
    assert {x["error"]["code"] for x in errors} == {"invalid_json", "bad_param", "missing_prompt", "prompt_too_long"}

    assert reference.wait(timeout=300) == 1  # 1: some requests failed
    ref = {r["custom_id"]: r["response"]["body"]["text"] for r in map(json.loads, open(tmp_path / "ref.jsonl"))}
    assert {x["custom_id"]: x["response"]["body"]["choices"][0]["text"] for x in out} == ref

    status = celeris("status", str(queue.config), "--json")
    counts = json.loads(status.stdout)["counts"]
    assert counts["pending"] == 0 and counts["in_progress"] == 0  # `celeris status` agrees: nothing left
