"""The queue decodes through the engine's running set (`spool.pool.RunningPool`): a file claimed while
another file's batches decode joins their running set as its rows leave, and every answer is the one its
request gets alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from celeris_cli.spool.backend import EngineBackend
from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool
from celeris_cli.spool.formats import Request
from celeris_cli.spool.pool import RunningPool

from .spool_helpers import drop, make_queue, outputs

A = [
    "床前明月光，",
    "白日依山尽，",
    "The old man",
    "春眠不觉晓，",
    "It was late",
    "The river",
    "红豆生南国，",
    "At night",
]
B = ["千山鸟飞绝，", "She opened the door", "Rain fell on", "独坐幽篁里，"]


class DropsAFileMidDecode:
    """The model, except that its `after`-th forward first drops file B into the inbox (a user's file
    arriving while the queue decodes)."""

    def __init__(self, model: Any, after: int, drop_b: Any) -> None:
        self.model, self.after, self.drop_b, self.forwards = model, after, drop_b, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def hidden(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.forwards += 1
        if self.forwards == self.after:
            self.drop_b()
        return self.model.hidden(ids, *args, **kwargs)


def test_a_file_arriving_mid_decode_is_admitted_while_another_files_batch_is_running(tmp_path: Path) -> None:
    cfg = load_config(make_queue(tmp_path, batch_size=4, generation={"gen_length": 24, "strategy": "spec"}))
    backend = EngineBackend(None, "cpu", "float32", 1, cfg.generation)  # the default model, its running set's spec
    model = backend.engine.model
    backend.engine.model = DropsAFileMidDecode(model, 8, lambda: drop(tmp_path, "b.txt", "\n".join(B) + "\n"))
    drop(tmp_path, "a.txt", "\n".join(A) + "\n")
    spool = Spool(cfg, lambda: backend)
    assert spool.run(once=True) == 0
    events = [json.loads(x) for x in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    files = {e["ticket"]: e["files"] for e in events if e["event"] == "batch"}
    submitted = {e["ticket"]: i for i, e in enumerate(events) if e["event"] == "submit"}
    answered = {e["ticket"]: i for i, e in enumerate(events) if e["event"] == "batch"}
    [b_first] = sorted(submitted[t] for t, f in files.items() if f == ["b.txt"])[:1]
    a_running = [t for t, f in files.items() if f == ["a.txt"] and submitted[t] < b_first < answered[t]]
    assert a_running, "b.txt's batch started only after a.txt's batches were done"
    assert any(e["event"] == "submit" and e["in_flight"] > 1 for e in events)  # batches shared the running set

    backend.engine.model = model
    got = {name: [line["response"]["body"]["text"] for line in lines] for name, lines in outputs(tmp_path).items()}

    def alone(prompt: str) -> str:
        [body] = backend.run([backend.prepare(Request("x", 1, prompt))])
        return str(body["text"])

    assert got == {"a.txt.results.jsonl": [alone(p) for p in A], "b.txt.results.jsonl": [alone(p) for p in B]}


def test_the_daemon_runs_the_engine_as_a_running_set_unless_one_batch_at_a_time_is_asked(tmp_path: Path) -> None:
    from celeris_cli.spool.pool import InlinePool, as_pool

    cfg = load_config(make_queue(tmp_path, generation={"gen_length": 8, "strategy": "spec"}))
    backend = EngineBackend(None, "cpu", "float32", 1, cfg.generation)
    assert isinstance(as_pool(backend, None, 4), RunningPool)
    assert isinstance(as_pool(backend, 30.0, 4), InlinePool)  # a per-batch timeout: one batch at a time


class FailsOnAToken:
    """The model, except that a forward whose ids hold `token` raises (a request whose decode fails)."""

    def __init__(self, model: Any, token: int) -> None:
        self.model, self.token = model, token

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def hidden(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if bool((ids == self.token).any()):
            raise RuntimeError("simulated failure of one request")
        return self.model.hidden(ids, *args, **kwargs)


def test_a_request_failing_in_the_running_set_fails_alone_and_other_files_are_answered(tmp_path: Path) -> None:
    cfg = load_config(make_queue(tmp_path, batch_size=2, generation={"gen_length": 16, "strategy": "spec"}))
    backend = EngineBackend(None, "cpu", "float32", 1, cfg.generation)
    tok = backend.engine.tokenizer
    good, bad, other = "The old man", "独坐幽篁里，", "The river"
    [token] = [t for t in tok.encode(bad) if t not in tok.encode(good) + tok.encode(other)][:1]
    model = backend.engine.model
    backend.engine.model = FailsOnAToken(model, token)
    drop(tmp_path, "a.txt", f"{good}\n{bad}\n")
    # a batch of one beside them (settings of its own), from another file: decoding beside the failing
    # request must not fail it
    drop(tmp_path, "b.jsonl", json.dumps({"prompt": other, "gen_length": 12}) + "\n")
    assert Spool(cfg, lambda: backend).run(once=True) == 1  # failures were recorded
    backend.engine.model = model
    got = {name: [line["response"]["body"]["text"] if line["error"] is None else None for line in lines]
           for name, lines in outputs(tmp_path).items()}  # fmt: skip
    failed = [json.loads(x) for x in (tmp_path / "logs" / "failed.jsonl").read_text().splitlines()]
    assert [(f["source"]["file"], f["source"]["line"], f["code"]) for f in failed] == [("a.txt", 2, "engine_error")]

    def alone(prompt: str) -> str:
        [body] = backend.run([backend.prepare(Request("x", 1, prompt))])
        return str(body["text"])

    [body] = backend.run([backend.prepare(Request("x", 1, other, params={"gen_length": 12}))])
    assert got["b.jsonl.results.jsonl"] == [body["text"]]
    assert got["a.txt.results.jsonl"][0] == alone(good)


def test_a_batch_that_cannot_join_the_running_set_decodes_on_its_own_beside_it(tmp_path: Path) -> None:
    """A strategy of no running set (`ar`, the default model's AR mode in static batches) keeps a row out of
    `spec`'s:
    its batch takes turns with the running set (`RunningPool.alone`), and every answer is still its
    request's alone."""
    cfg = load_config(make_queue(tmp_path, batch_size=2, generation={"gen_length": 16, "strategy": "spec"}))
    backend = EngineBackend(None, "cpu", "float32", 1, cfg.generation)
    lines = [{"prompt": "The old man"}, {"prompt": "床前明月光，", "strategy": "ar"}, {"prompt": "The river"}]
    drop(tmp_path, "g.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    pool = RunningPool(backend, 2)
    alone_batches: list[int] = []
    run = backend.run
    backend.run = lambda batch: alone_batches.append(len(batch)) or run(batch)  # type: ignore[method-assign]
    try:
        from celeris_cli.spool import daemon

        real = daemon.as_pool
        daemon.as_pool = lambda *a, **k: pool  # type: ignore[assignment]
        assert Spool(cfg, lambda: backend).run(once=True) == 0
    finally:
        daemon.as_pool = real
        del backend.run
    assert alone_batches == [1]  # only the ar-strategy row decoded on its own
    got = [line["response"]["body"]["text"] for line in outputs(tmp_path)["g.jsonl.results.jsonl"]]
    want = []
    for x in lines:
        params = {k: v for k, v in x.items() if k != "prompt"}
        [body] = backend.run([backend.prepare(Request("x", 1, x["prompt"], params=params))])
        want.append(body["text"])
    assert got == want
