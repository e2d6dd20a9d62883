"""What a batch's own bytes can do to `celeris serve --queue`, with the real `openai` client on a real server
and a real `celeris watch` beside it: metadata past OpenAI's limits is a 400 before anything is stored, a
record already on disk that cannot be read is reported and never takes the list down, a line holding a
5000-digit number is that line's error while the rest run, a line's default id never collides with an id
another line gives, and a retried cancelled batch resubmits the lines that never ran."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .serve_helpers import Server, Watch, wait_for
from .spool_helpers import make_queue

MODEL = "celeris-block"


class Queue:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = make_queue(root, model=Path(MODEL), generation={}, batch_size=2)  # parts of 4 lines
        self.server = Server("--queue", str(self.config), log=root / "serve.log").start()
        self.watch: Watch | None = None

    def start_watch(self) -> None:
        if self.watch is None:
            self.watch = Watch(self.config, self.root / "watch.log").start()

    @property
    def client(self) -> openai.OpenAI:
        return self.server.client()  # type: ignore[no-any-return]

    def upload(self, lines: list[str]) -> str:
        data = ("\n".join(lines) + "\n").encode()
        return self.client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id

    def create(self, file_id: str, **extra: Any) -> tuple[int, Any]:
        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h", **extra}
        return self.server.post("/v1/batches", json.dumps(body).encode())  # type: ignore[no-any-return]

    def wait(self, batch_id: str, *status: str) -> Any:
        return wait_for(lambda: (b := self.client.batches.retrieve(batch_id)).status in status and b, every=0.3)

    def lines(self, file_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.client.files.content(file_id).text.splitlines()]

    def stop(self) -> None:
        self.server.stop()
        if self.watch is not None:
            self.watch.stop()


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queue]:
    q = Queue(tmp_path_factory.mktemp("lines"))
    yield q
    q.stop()
    assert "Traceback" not in (q.root / "serve.log").read_text(encoding="utf-8")  # every error was answered


def line(custom_id: str | None, prompt: str = "The quick", seed: int = 0, **body: Any) -> str:
    obj: dict[str, Any] = {"custom_id": custom_id} if custom_id is not None else {}
    obj |= {"method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, "max_tokens": 8, "seed": seed}}
    obj["body"] |= body
    return json.dumps(obj)


def records(queue: Queue) -> set[str]:
    return {p.name for p in (queue.root / "serve" / "batches").glob("batch_*")}


@pytest.mark.parametrize(
    "metadata, words",
    [
        ({"k": "\ud800"}, "lone surrogate"),
        ({"\udfff": "v"}, "lone surrogate"),
        ({f"k{i}": "v" for i in range(17)}, "at most 16"),
        ({"k" * 65: "v"}, "at most 64"),
        ({"k": "v" * 513}, "at most 512"),
        ({"k": 1}, "string"),
    ],
)
def test_metadata_past_openais_limits_is_a_400_and_nothing_is_stored(
    queue: Queue, metadata: dict[str, Any], words: str
) -> None:
    file_id = queue.upload([line("m0")])
    before = records(queue)
    status, body = queue.create(file_id, metadata=metadata)
    assert status == 400 and body["error"]["param"] == "metadata" and words in body["error"]["message"]
    assert records(queue) == before and not list((queue.root / "batch_inputs").glob("batch_*"))
    assert queue.server.get("/v1/batches")["object"] == "list"


def test_metadata_at_openais_limits_is_kept(queue: Queue) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 511 + "é" for i in range(16)}
    status, body = queue.create(queue.upload([line("m1")]), metadata=metadata)
    assert status == 200 and body["metadata"] == metadata
    assert queue.client.batches.cancel(body["id"]).status == "cancelled"  # before any daemon: never decoded


def test_records_on_disk_that_cannot_be_read_are_listed_as_such_and_the_rest_answer(
    tmp_path: Path,
) -> None:
    """Records as an older server left them (metadata with a lone surrogate), torn, or missing a field,
    already on disk when the server starts: the list and each batch answer 200, a bad record is a `failed`
    batch whose error says it cannot be read, a good one is as it was, and the files are left alone."""
    first = Queue(tmp_path)
    try:
        status, good = first.create(first.upload([line("g0")]), metadata={"k": "v"})
        assert status == 200
    finally:
        first.stop()
    folder = tmp_path / "serve" / "batches"
    record = json.loads((folder / f"{good['id']}.json").read_text(encoding="utf-8"))
    partless = {k: v for k, v in record.items() if k != "parts"}
    bad = {
        "batch_" + "a" * 24: json.dumps({**record, "id": "batch_" + "a" * 24, "metadata": {"k": "\ud800"}}),
        "batch_" + "b" * 24: '{"id": "batch_' + "b" * 24 + '", "status": "in_pro',
        "batch_" + "c" * 24: json.dumps({**partless, "id": "batch_" + "c" * 24}),
    }
    for batch_id, text in bad.items():
        (folder / f"{batch_id}.json").write_text(text, encoding="utf-8")
    second = Queue(tmp_path)
    try:
        listed = {b.id: b for b in second.client.batches.list().data}
        assert set(listed) == {good["id"], *bad}
        assert listed[good["id"]].status == "validating" and listed[good["id"]].metadata == {"k": "v"}
        for batch_id in bad:
            one = second.client.batches.retrieve(batch_id)
            assert one.status == "failed" and one.errors is not None and one.errors.data is not None
            assert one.errors.data[0].code == "unreadable_record" and "cannot read" in str(one.errors.data[0].message)
            assert (folder / f"{batch_id}.json").read_text(encoding="utf-8") == bad[batch_id]  # left alone
            with pytest.raises(openai.BadRequestError):
                second.client.batches.cancel(batch_id)
        assert second.client.batches.retrieve(good["id"]).metadata == {"k": "v"}
    finally:
        second.stop()


def test_a_5000_digit_number_is_its_lines_error_and_the_rest_run(queue: Queue) -> None:
    huge = '{"custom_id": "huge", "body": {"prompt": "x", "max_tokens": ' + "9" * 5000 + "}}"
    file_id = queue.upload([line("d0"), huge, line("d2", seed=2)])
    batch = queue.client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    queue.start_watch()
    done = queue.wait(batch.id, "completed", "failed")
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert [x["custom_id"] for x in queue.lines(done.output_file_id)] == ["d0", "d2"]
    (err,) = queue.lines(done.error_file_id)
    assert err["custom_id"] == "line-2" and "digits" in err["error"]["message"]


def test_a_line_without_an_id_never_collides_with_an_id_another_line_gives(queue: Queue) -> None:
    lines = [line(None, seed=1), line("line-1", seed=2), line("line-3-auto", seed=3), line(None, seed=4)]
    lines.insert(2, line("line-4", seed=5))  # and the other way round: the unnamed line 4 comes later
    batch = queue.client.batches.create(
        input_file_id=queue.upload(lines), endpoint="/v1/completions", completion_window="24h"
    )
    queue.start_watch()
    done = queue.wait(batch.id, "completed", "failed")
    ids = [x["custom_id"] for x in queue.lines(done.output_file_id)]
    assert done.error_file_id is None and ids == ["line-1-auto", "line-1", "line-4", "line-3-auto", "line-5"]
    with pytest.raises(openai.BadRequestError) as e:  # an id the user did write twice is still refused
        queue.client.batches.create(
            input_file_id=queue.upload([line("same"), line("same")]),
            endpoint="/v1/completions",
            completion_window="24h",
        )
    assert "line 2" in e.value.message


def test_retrying_a_cancelled_batch_resubmits_the_lines_that_never_ran(queue: Queue) -> None:
    """Cancelled before the daemon claims it (the daemon is held off by taking its inbox's first part away
    by hand, as a claim): none of its lines ran, and a retry is a batch of all of them, with their ids."""
    lines = [line(f"r{i}", seed=i) for i in range(10)]
    lines[5] = json.dumps({"body": {"prompt": "no id", "max_tokens": 8}})  # its id: line-6
    if queue.watch is not None:  # the daemon must not claim before the cancel
        queue.watch.stop()
        queue.watch = None
    batch = queue.client.batches.create(
        input_file_id=queue.upload(lines), endpoint="/v1/completions", completion_window="24h"
    )
    cancelled = queue.client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled"
    retry = queue.client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch)
    assert retry.metadata == {"retry_of": batch.id} and retry.request_counts is not None
    assert retry.request_counts.total == 10
    queue.start_watch()
    done = queue.wait(retry.id, "completed", "failed")
    got = [x["custom_id"] for x in queue.lines(done.output_file_id)]
    assert got == [f"r{i}" if i != 5 else "line-6" for i in range(10)]
    assert os.path.exists(queue.root / "serve" / "batches" / f"{batch.id}.input")
