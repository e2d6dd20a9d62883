"""The runner under the routes: rows join the engine's running set as they arrive (while others decode)
and answer as they do alone, no forward runs more rows than the batch size, a row whose client left
before it joined is never decoded, a failing row fails alone, rows the running set cannot take (the default
model's `ar`) decode in static batches, the block hook that streaming reads, and the concurrency limit and disconnects
through the real app (in-process, on a loopback port). A tiny random block-causal model; a gate at the
model boundary holds the first forward while the test arranges the queue."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli.engine import Engine, load_engine
from celeris_cli.serve.runner import Runner
from celeris_cli.spool.formats import Request

from .conftest import make_model
from .serve_helpers import free_port, wait_for


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Engine:
    folder = make_model(tmp_path_factory.mktemp("block") / "m", tiny_tokenizer, block_causal=True)
    return load_engine(folder, device="cpu", dtype="float32")


class Gate:
    """The model, wrapped at its boundary: records the ids of each forward, holds every forward until
    released, and raises for a forward holding the token `fail_on` (a request whose decode fails)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[torch.Tensor] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail_on: int | None = None
        self.oom = False  # every forward runs out of memory

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)

    def hidden(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(ids.clone())
        self.started.set()
        assert self.release.wait(60)
        if self.fail_on is not None and bool((ids == self.fail_on).any()):
            raise RuntimeError("simulated failure")
        if self.oom:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return self.model.hidden(ids, *args, **kwargs)

    def seen(self, token: int) -> bool:
        return any(bool((ids == token).any()) for ids in self.calls)

    @property
    def widest(self) -> int:
        return max(ids.shape[0] for ids in self.calls)


@pytest.fixture()
def gated(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Runner, Gate]]:
    gate = Gate(engine.model)
    monkeypatch.setattr(engine, "model", gate)
    runner = Runner(engine, {"gen_length": 16, "temperature": 1.0}, max_batch=8)
    yield runner, gate
    gate.release.set()
    runner.close()


def req(prompt: str, **params: Any) -> Request:
    return Request("r", 0, prompt=prompt, params={"seed": 1, **params})


def only_in(engine: Engine, prompt: str, *others: str) -> int:
    """A token of `prompt`'s that none of `others` has."""
    theirs = {t for o in others for t in engine.encode_prompt(o)}
    return next(t for t in engine.encode_prompt(prompt) if t not in theirs)


def test_rows_arriving_while_others_decode_join_the_running_set_and_answer_as_alone(
    gated: tuple[Runner, Gate], engine: Engine
) -> None:
    runner, gate = gated
    long, short = runner.prepare(req("The quick", gen_length=64)), runner.prepare(req("床前明月光，", gen_length=8))
    first = runner.submit([long, short])
    assert gate.started.wait(30)  # the worker holds the first forward; more rows arrive meanwhile
    later = [runner.prepare(req("To be, or not", gen_length=8)), runner.prepare(req("白日依山尽，", block_steps=2))]
    futures = first + runner.submit(later)  # other settings share the running set too
    finished: list[int] = []
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: finished.append(i))
    gate.release.set()
    answers = [f.result(60) for f in futures]
    assert finished.index(2) < finished.index(0)  # a later short row joined, and left, while the long one ran
    for prepared, answer in zip([long, short, *later], answers):
        assert runner.submit([prepared])[0].result(60).text == answer.text


def test_no_forward_runs_more_rows_than_the_batch_size(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(engine.model)
    gate.release.set()
    monkeypatch.setattr(engine, "model", gate)
    runner = Runner(engine, {"gen_length": 16}, max_batch=2)
    try:
        futures = runner.submit([runner.prepare(req(p, seed=i)) for i, p in enumerate(["床前", "To be", "白日", "A"])])
        assert all(f.result(60).text is not None for f in futures)
        assert gate.widest == 2
    finally:
        runner.close()


def test_a_row_whose_client_left_is_dropped_before_decoding(gated: tuple[Runner, Gate], engine: Engine) -> None:
    runner, gate = gated
    runner.submit([runner.prepare(req("The quick"))])
    assert gate.started.wait(30)
    gone, kept = runner.submit([runner.prepare(req("床前明月光，")), runner.prepare(req("To be, or not"))])
    assert gone.cancel()
    gate.release.set()
    assert kept.result(60).text is not None
    assert not gate.seen(only_in(engine, "床前明月光，", "The quick", "To be, or not"))
    assert gate.seen(only_in(engine, "To be, or not", "The quick", "床前明月光，"))


def test_a_row_that_fails_in_the_running_set_fails_alone(gated: tuple[Runner, Gate], engine: Engine) -> None:
    runner, gate = gated
    gate.fail_on = only_in(engine, "床前明月光，", "The quick", "To be, or not")
    futures = runner.submit([runner.prepare(req(p)) for p in ("The quick", "床前明月光，", "To be, or not")])
    gate.release.set()
    assert futures[0].result(60).text is not None and futures[2].result(60).text is not None
    with pytest.raises(RuntimeError, match="simulated"):
        futures[1].result(60)


def test_a_row_whose_client_left_in_flight_leaves_the_running_set(gated: tuple[Runner, Gate]) -> None:
    """--max-concurrent counts a client that hung up as gone: its row must stop taking a place in every
    forward too (`Runner.drop` -> `LiveRun.cancel`), not decode on to its end."""
    runner, gate = gated
    short, gone, kept = (runner.prepare(req(p, gen_length=n)) for p, n in (("A", 8), ("The quick", 64), ("To be", 64)))
    futures = runner.submit([short, gone, kept])
    assert gate.started.wait(30)
    assert futures[1].running()  # in the running set, in flight
    answered_at: list[int] = []
    futures[0].add_done_callback(lambda _: answered_at.append(len(gate.calls)))
    assert runner.drop(futures[1])
    gate.release.set()
    alone = futures[2].result(60)
    assert max(ids.shape[0] for ids in gate.calls[answered_at[0] :]) == 1  # only `kept` after the next answer
    assert not futures[1].done()  # never answered
    assert runner.submit([kept])[0].result(60).text == alone.text  # its mate leaving changed nothing


def test_a_row_whose_client_left_while_it_waited_in_the_running_set_never_decodes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(engine.model)
    monkeypatch.setattr(engine, "model", gate)
    runner = Runner(engine, {"gen_length": 16}, max_batch=1)  # one row in flight, the other waits in the set
    try:
        first, gone = runner.submit([runner.prepare(req("The quick")), runner.prepare(req("床前明月光，"))])
        assert gate.started.wait(30)
        assert gone.running()  # taken into the running set, waiting there
        assert runner.drop(gone)
        gate.release.set()
        assert first.result(60).text is not None
        assert not gate.seen(only_in(engine, "床前明月光，", "The quick")) and not gone.done()
    finally:
        gate.release.set()
        runner.close()


def test_rows_out_of_memory_alone_are_too_large_naming_what_to_lower(gated: tuple[Runner, Gate]) -> None:
    from celeris_cli.errors import TooLarge

    runner, gate = gated
    gate.oom = True
    rows = [runner.prepare(req(p, cfg_scale=1.5, strategy="block")) for p in ("The quick", "To be, or not")]
    futures = runner.submit(rows)  # the running set out of memory: narrower, then each row alone
    gate.release.set()
    for f in futures:
        with pytest.raises(TooLarge, match="lower gen_length"):
            f.result(60)


@pytest.fixture(scope="module")
def default_engine() -> Engine:
    return load_engine(None, device="cpu", dtype="float32")  # its `ar` decodes in static batches


def test_a_static_batch_with_one_failing_row_answers_the_others_and_the_worker_lives_on(
    default_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = default_engine
    gate = Gate(engine.model)
    monkeypatch.setattr(engine, "model", gate)
    runner = Runner(engine, {"gen_length": 16, "temperature": 1.0}, max_batch=8)
    try:
        gate.release.set()
        prompts = ("The quick", "To be, or not", "The jury said it")
        rows = [runner.prepare(req(p, strategy="ar")) for p in prompts]
        assert not engine.continuous(rows[0].group)
        alone = [runner.submit([r])[0].result(60).text for r in rows]
        gate.fail_on = only_in(engine, prompts[1], prompts[0], prompts[2])
        futures = runner.submit(rows)  # a static batch: halved down to the row that fails alone
        assert futures[0].result(60).text == alone[0] and futures[2].result(60).text == alone[2]
        with pytest.raises(RuntimeError, match="simulated failure"):
            futures[1].result(60)
        gate.fail_on = None
        _unplannable(engine, runner, rows[0])
        assert runner.submit(rows[:1])[0].result(60).text == alone[0]  # the worker is still there
    finally:
        gate.release.set()
        runner.close()


def test_a_row_the_running_set_cannot_plan_fails_alone_and_the_worker_lives_on(
    gated: tuple[Runner, Gate], engine: Engine
) -> None:
    runner, gate = gated
    gate.release.set()
    row = runner.prepare(req("The quick", strategy="block"))
    assert engine.continuous(row.group)
    alone = runner.submit([row])[0].result(60).text
    _unplannable(engine, runner, row)
    assert runner.submit([row])[0].result(60).text == alone  # the worker is still there


def _unplannable(engine: Engine, runner: Runner, row: Any) -> None:
    """A failure outside any decode (the memory estimate): the row fails, not the worker."""

    def unplannable(*args: Any) -> int:
        raise ValueError("no plan")

    budget, need = engine.memory.budget, engine.memory.need
    engine.memory.budget, engine.memory.need = 10**12, unplannable  # type: ignore[method-assign]
    try:
        with pytest.raises(ValueError, match="no plan"):
            runner.submit([row])[0].result(60)
    finally:
        engine.memory.budget, engine.memory.need = budget, need  # type: ignore[method-assign]


def test_guided_block_rows_together_answer_as_alone(gated: tuple[Runner, Gate]) -> None:
    runner, gate = gated
    gate.release.set()
    rows = [runner.prepare(req(p, cfg_scale=1.5, strategy="block")) for p in ("The quick", "To be, or not")]
    together = [f.result(60).text for f in runner.submit(rows)]
    assert together == [runner.submit([r])[0].result(60).text for r in rows]


@pytest.mark.parametrize("strategy", ["block", "block-fast"])
def test_the_block_hook_sees_each_rows_committed_ids_grow_to_its_answer(engine: Engine, strategy: str) -> None:
    params = engine.params({"strategy": strategy, "gen_length": 24, "temperature": 1.0, "seed": 4})
    prompts = [engine.encode_prompt(p) for p in ["The quick", "床前明月光，疑是地上霜。"]]
    seen: dict[int, list[list[int]]] = {0: [], 1: []}
    hooked, _ = engine.decode_ids(prompts, params, [4, 5], on_block=lambda b, ids: seen[b].append(ids))
    plain, _ = engine.decode_ids(prompts, params, [4, 5])
    assert hooked == plain  # the hook only reads
    for b in (0, 1):
        grown = seen[b]
        assert len(grown) > 1 and all(a == b_[: len(a)] and len(a) < len(b_) for a, b_ in zip(grown, grown[1:]))
        assert grown[-1] == plain[b][: len(grown[-1])]
        assert mask_free(grown, engine)


def mask_free(grown: list[list[int]], engine: Engine) -> bool:
    """Committed ids hold no mask before the row's first stop token."""
    for ids in grown:
        for t in ids:
            if t in engine.special.stop_ids:
                break
            if t == engine.special.mask_id:
                return False
    return True


# -- through the app: the concurrency limit and a client that disconnects --------------------------------
@pytest.fixture()
def app_server(gated: tuple[Runner, Gate]) -> Iterator[tuple[Any, str, Gate]]:
    import uvicorn

    from celeris_cli.serve.app import create_app
    from celeris_cli.serve.settings import Keys, Limits
    from celeris_cli.serve.state import ServeState

    runner, gate = gated
    state = ServeState(runner, "tiny", Limits(max_concurrent=2), Keys())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30)
    yield state, f"http://127.0.0.1:{port}", gate
    gate.release.set()
    server.should_exit = True
    thread.join(timeout=30)


def _post(url: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
    import json
    import urllib.error
    import urllib.request

    r = urllib.request.Request(url + "/v1/completions", data=body, method="POST")
    r.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(r, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


def test_requests_over_the_concurrency_limit_get_429(app_server: tuple[Any, str, Gate]) -> None:
    state, url, gate = app_server
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda p=p: results.append(_post(url, p)[0]))
        for p in (b'{"prompt": "The quick"}', b'{"prompt": "To be"}')
    ]
    for t in threads:
        t.start()
    wait_for(lambda: state.in_flight == 2, timeout=30)
    status, body, headers = _post(url, b'{"prompt": "one too many"}')
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert headers["retry-after"] == "1"
    gate.release.set()
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_a_request_too_large_for_memory_is_a_400_too_large(app_server: tuple[Any, str, Gate]) -> None:
    _, url, gate = app_server
    gate.oom = True
    gate.release.set()
    status, body, _ = _post(url, b'{"prompt": "The quick", "cfg_scale": 1.5, "strategy": "block"}')
    assert status == 400 and body["error"]["code"] == "too_large" and "lower" in body["error"]["message"]


def test_a_client_that_disconnects_frees_its_row(app_server: tuple[Any, str, Gate], engine: Engine) -> None:
    state, url, gate = app_server
    first = threading.Thread(target=lambda: _post(url, b'{"prompt": "The quick"}'))
    first.start()
    assert gate.started.wait(30)
    port = int(url.rsplit(":", 1)[1])
    body = b'{"prompt": "To be, or not"}'
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
        s.sendall(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: state.in_flight == 2, timeout=30)
    wait_for(lambda: state.metrics.dropped._value.get() == 1, timeout=30)
    gate.release.set()
    first.join()
    time.sleep(0.2)
    assert not gate.seen(only_in(engine, "To be, or not", "The quick"))
    wait_for(lambda: state.in_flight == 0, timeout=30)


def test_streamed_text_holds_back_what_a_stop_string_or_a_split_character_could_still_change() -> None:
    from celeris_cli.serve.completions import held_back

    assert held_back("Hello, wor", ()) == "Hello, wor"
    assert held_back("Hello, wor", ("world!",)) == "Hello"  # "wor" + later "ld!" may still be cut
    assert held_back("Hello", ("\n\n", "END")) == "Hel"
    assert held_back("abc\ufffd\ufffd", ()) == "abc"  # bytes of a character not yet whole
    assert held_back("ab", ("longer stop",)) == ""


def test_requests_of_two_strategies_join_one_running_set_and_answer_as_alone(
    default_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model's diffusion mode and its self-speculation submitted together: both kinds join the one
    running set (`KindSet`), none is decoded as a static batch, and each answer is its request's alone."""
    runner = Runner(default_engine, {"gen_length": 16, "temperature": 1.0}, max_batch=4)
    static: list[int] = []
    monkeypatch.setattr(runner, "_run", lambda rows: static.append(len(rows)))
    try:
        asked = [
            ("The quick", "nemotron"),
            ("To be, or not", "spec"),
            ("床前明月光，", "spec"),
            ("The jury", "nemotron"),
        ]
        rows = [runner.prepare(req(p, strategy=s)) for p, s in asked]
        together = [f.result(60).text for f in runner.submit(rows)]
        assert runner.live.kinds == {"seeded", "spec"} and static == []
        assert together == [runner.submit([r])[0].result(60).text for r in rows]
    finally:
        runner.close()
