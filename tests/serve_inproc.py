"""The server's Batch API on real HTTP without a model: the real app under uvicorn in a thread on a free
loopback port, a fake runner (the model boundary: batch routes never decode), and the queue's moves made
by hand (`FakeDaemon`) as `celeris watch` makes them. In-process, so a test can make the disk full by
monkeypatching a write."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from celeris_cli.serve.app import create_app
from celeris_cli.serve.batches import BatchStore
from celeris_cli.serve.files import FileStore
from celeris_cli.serve.settings import Keys, Limits
from celeris_cli.serve.state import ServeState
from celeris_cli.spool.config import load_config

from .serve_helpers import free_port
from .spool_helpers import make_queue

USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


class FakeRunner:
    depth = 0

    def close(self) -> None:
        pass


class App:
    """The app over a queue folder at `root`, on `http://127.0.0.1:<port>`."""

    def __init__(self, root: Path, keys: tuple[str, ...] = (), batch_size: int = 16, **limits: Any) -> None:
        self.root = root
        self.config = make_queue(root, batch_size=batch_size)
        cfg = load_config(self.config)
        files = FileStore(root / "serve" / "files")
        self.batches = BatchStore(root / "serve" / "batches", cfg, files, "m")
        keyset = Keys(tuple(k.encode() for k in keys))
        state = ServeState(FakeRunner(), "m", Limits(**limits), keyset, files, self.batches, cfg)  # type: ignore[arg-type]
        self.port = free_port()
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.daemon = FakeDaemon(root)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> App:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, key: str = "none") -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)


class FakeDaemon:
    """The queue's moves, by hand: claim a part, journal outcomes, publish results and failure records."""

    def __init__(self, root: Path) -> None:
        self.inbox = root / "batch_inputs"
        self.work = self.inbox / ".work"
        self.root = root
        self.claims = 0

    def pending(self, batch_id: str) -> list[str]:
        return sorted(p.name for p in self.inbox.glob(f"{batch_id}.*.jsonl"))

    def claim(self, name: str) -> Path:
        self.claims += 1
        self.work.mkdir(exist_ok=True)
        claimed = self.work / f"{self.claims:08d}.{name}"
        os.rename(self.inbox / name, claimed)
        return claimed

    def journal(self, claimed: Path, outcomes: list[dict[str, Any]]) -> None:
        (self.work / "journal").mkdir(exist_ok=True)
        path = self.work / "journal" / f"{claimed.name.partition('.')[0]}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"outcomes": outcomes}) + "\n")

    def publish(self, claimed: Path, fail: tuple[int, ...] = (), code: str = "poison") -> list[dict[str, Any]]:
        """Answer every line of a claimed part (the lines `fail` with failure records) and move it to
        processed/, as the daemon's publish does. Returns its requests."""
        name = claimed.name.partition(".")[2]
        reqs = [(n, json.loads(raw)) for n, raw in enumerate(claimed.read_bytes().split(b"\n"), 1) if raw.strip()]
        with open(self.root / "batch_outputs" / f"{name}.results.jsonl", "w") as out:
            for n, obj in reqs:
                if n not in fail:
                    body = {"text": f"answer {obj['custom_id']}", "finish_reason": "length", "usage": USAGE}
                    rec = {"id": f"{name}:{n}", "custom_id": obj["custom_id"], "response": {"body": body}}
                    out.write(json.dumps(rec) + "\n")
        with open(self.root / "logs" / "failed.jsonl", "a") as log:
            for n, obj in reqs:
                if n in fail:
                    rec = {"key": f"{name}:{n}", "output": f"{name}.results.jsonl", "custom_id": obj["custom_id"]}
                    rec |= {"source": {"file": name, "line": n}, "code": code, "message": "in flight at 3 deaths"}
                    log.write(json.dumps(rec) + "\n")
        os.rename(claimed, self.root / "batch_processed" / name)
        return [obj for _, obj in reqs]


def batch_line(custom_id: str | None, prompt: str = "x", url: str = "/v1/completions") -> str:
    obj: dict[str, Any] = {"method": "POST", "url": url, "body": {"prompt": prompt, "max_tokens": 8}}
    if custom_id is not None:
        obj["custom_id"] = custom_id
    return json.dumps(obj)
