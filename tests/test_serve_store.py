"""The batch store over the queue's folders, without a server or a daemon: the status each place of the
file maps to, the OpenAI output and error lines made from the queue's own files, a publish the server
died before, and paging. The queue's moves are made by hand here, as the daemon makes them."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from celeris_cli.serve.batches import BatchStore
from celeris_cli.serve.files import FileStore
from celeris_cli.spool.config import load_config

from .spool_helpers import make_queue


@pytest.fixture()
def store(tmp_path: Path) -> BatchStore:
    cfg = load_config(make_queue(tmp_path))
    files = FileStore(tmp_path / "serve" / "files")
    return BatchStore(tmp_path / "serve" / "batches", cfg, files, "m")


def create(store: BatchStore, lines: list[str], endpoint: str = "/v1/completions") -> dict:
    meta = store.files.add_stream(io.BytesIO(("\n".join(lines) + "\n").encode()), "in.jsonl", "batch")
    return store.create(None, meta["id"], endpoint, "24h", None)


LINES = [
    json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    "{broken",
    json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}),
]


def test_each_place_of_the_queue_file_is_a_batch_status(store: BatchStore, tmp_path: Path) -> None:
    batch = create(store, LINES)
    name = f"{batch['id']}.0000.jsonl"  # its one part
    inbox, work = tmp_path / "batch_inputs", tmp_path / "batch_inputs" / ".work"
    assert batch["status"] == "validating" and (inbox / name).is_file()
    work.mkdir(exist_ok=True)
    os.rename(inbox / name, work / f"00000007.{name}")  # claimed
    (work / "journal").mkdir()
    outcome = {"line": 1, "body": {"text": "t", "finish_reason": "stop", "usage": {}}}
    (work / "journal" / "00000007.jsonl").write_text(json.dumps({"outcomes": [outcome]}) + "\n")
    got = store.get(batch["id"])
    assert got is not None and got["status"] == "in_progress" and got["request_counts"]["completed"] == 1
    use = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    results = [
        {
            "id": f"{name}:{n}",
            "custom_id": c,
            "response": {"status_code": 200, "body": {"text": t, "finish_reason": "stop", "usage": use}},
        }
        for n, c, t in ((1, "a", "one"), (3, "b", "two"))
    ]
    (tmp_path / "batch_outputs" / f"{name}.results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    failure = {"key": f"7/{name}:2:1", "claim": 7, "output": f"{name}.results.jsonl", "custom_id": None}
    failure |= {"source": {"file": name, "line": 2}, "code": "invalid_json", "message": "not valid JSON"}
    (tmp_path / "logs" / "failed.jsonl").write_text(json.dumps(failure) + "\n" + json.dumps(failure) + "\n")
    os.rename(work / f"00000007.{name}", tmp_path / "batch_processed" / name)  # published
    assert store.get(batch["id"])["status"] == "finalizing"  # type: ignore[index]  # a read writes nothing
    assert store.get(batch["id"])["output_file_id"] is None  # type: ignore[index]
    store.advance(batch["id"])  # the follower
    done = store.get(batch["id"])
    assert done is not None and done["status"] == "completed"
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = [json.loads(x) for x in store.files.path(done["output_file_id"]).read_text().splitlines()]
    assert [set(x) for x in out] == [{"id", "custom_id", "response", "error"}] * 2
    assert out[0]["custom_id"] == "a" and out[0]["error"] is None and out[0]["id"].startswith("batch_req_")
    assert set(out[0]["response"]) == {"status_code", "request_id", "body"}
    body = out[0]["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "one" and body["usage"] == use
    errors = [json.loads(x) for x in store.files.path(done["error_file_id"]).read_text().splitlines()]
    assert errors == [
        {
            "id": errors[0]["id"],
            "custom_id": "line-2",  # the queue's name for a line without an id
            "response": None,
            "error": {"code": "invalid_json", "message": "line 2: not valid JSON"},
        }
    ]  # the record twice in the log (a redone append) is one error line


def test_a_batch_whose_publish_the_server_died_before_is_published_at_start(store: BatchStore, tmp_path: Path) -> None:
    batch = create(store, LINES)
    (tmp_path / "batch_inputs" / f"{batch['id']}.0000.jsonl").unlink()  # as if the server died before the rename
    again = BatchStore(store.folder, load_config(tmp_path / "configs" / "batch.yaml"), store.files, "m")
    again.recover()
    assert (tmp_path / "batch_inputs" / f"{batch['id']}.0000.jsonl").read_text().splitlines() == LINES
    assert again.get(batch["id"])["status"] == "validating"  # type: ignore[index]


def test_batches_are_listed_newest_first_a_page_at_a_time(store: BatchStore) -> None:
    ids = [create(store, LINES[:1])["id"] for _ in range(3)]
    for i, batch_id in enumerate(ids):  # distinct creation times, oldest first
        store.index[batch_id]["created_at"] = 1000 + i
    page, more = store.page(None, None, 2)
    assert [b["id"] for b in page] == ids[::-1][:2] and more
    page, more = store.page(None, page[-1]["id"], 2)
    assert [b["id"] for b in page] == [ids[0]] and not more


def test_a_lost_publish_whose_input_was_deleted_is_published_from_the_batchs_own_link(
    store: BatchStore, tmp_path: Path
) -> None:
    batch = create(store, LINES)
    part = tmp_path / "batch_inputs" / f"{batch['id']}.0000.jsonl"
    part.unlink()
    assert store.files.delete(batch["input_file_id"])
    store.recover()
    assert part.read_text().splitlines() == LINES
    assert store.get(batch["id"])["status"] == "validating"  # type: ignore[index]


def test_the_state_folder_serve_makes_in_a_checkout_is_ignored_by_git_and_its_code_is_not() -> None:
    """`celeris serve --queue configs/batch.yaml` keeps its state in `serve/` beside the queue's folders."""
    import shutil
    import subprocess

    repo = Path(__file__).parents[1]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=repo).returncode == 0

    assert ignored("serve/batches/batch_0.json") and ignored("serve/files/file-0")
    assert not ignored("celeris_cli/serve/app.py") and not ignored("docs/serve.md")
