"""`celeris batch` decodes through the queue's pool (`spool.pool.RunningPool` over the engine's running
set): the next batch's rows start while an earlier batch is still running, and every answer is the one its
request gets alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from celeris_cli.batch.local import LocalExecutor
from celeris_cli.spool.backend import EngineBackend
from celeris_cli.spool.formats import Request
from celeris_cli.spool.pool import InlinePool, RunningPool

PROMPTS = ["The old man", "It was late", "The river", "At night", "She opened the door", "Rain fell on"]


class Recorder:
    """The model, recording each forward's token ids (the model boundary)."""

    def __init__(self, model: Any) -> None:
        self.model, self.seen = model, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def hidden(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(ids.tolist())
        return self.model.hidden(ids, *args, **kwargs)


def _prefilled(forward: list[list[int]], prompt: list[int]) -> bool:
    """Whether a forward computed the prompt: a row holds it (a packed forward lays rows end to end)."""
    n = len(prompt)
    return any(row[i : i + n] == prompt for row in forward for i in range(len(row) - n + 1))


@pytest.mark.parametrize(
    "name, kind",
    [(None, "spec"), ("celeris-block", "block"), ("celeris-tiny", "waves")],
    ids=["self-spec", "block", "bidirectional"],
)
def test_a_later_batch_starts_while_an_earlier_one_is_still_running_and_answers_as_alone(
    name: str | None, kind: str
) -> None:
    """Self-speculation (the default model's `spec`), block diffusion (celeris-block) and a bidirectional model's fast
    strategy (celeris-tiny) alike."""
    # greedy: where each row ends (which lets a later batch in early) does not move with the sampler's numbers
    settings = {"gen_length": 32, "temperature": 0.0, **({"strategy": "spec"} if kind == "spec" else {})}
    backend = EngineBackend(name, "cpu", "float32", 1, settings)
    executor = LocalExecutor(backend, batch_size=2)
    assert isinstance(executor.pool, RunningPool)
    model = backend.engine.model
    recorder = Recorder(model)
    backend.engine.model = recorder
    # the first batch (the shortest prompts) must hold a row that ends early: the default model runs "The old
    # man" and "At night" to their length at the same round, and stops "It was late" at its 22nd token
    prompts = [PROMPTS[1], PROMPTS[0], *PROMPTS[2:]] if kind == "spec" else PROMPTS
    requests = [Request(f"r{i}", i + 1, p) for i, p in enumerate(prompts)]
    yielded_at: list[tuple[int, list[str]]] = []  # (forwards so far, the batch's custom ids)
    got: dict[str, str] = {}
    for outcomes in executor.run(requests):
        yielded_at.append((len(recorder.seen), [oc.request.custom_id for oc in outcomes]))
        for oc in outcomes:
            assert oc.body is not None, oc.message
            got[oc.request.custom_id] = oc.body["text"]
    backend.engine.model = model
    assert len(yielded_at) == 3 and all(len(ids) == 2 for _, ids in yielded_at)  # three batches of two
    assert isinstance(executor.pool, RunningPool) and executor.pool.live.kinds == {kind}

    first_done, first_ids = yielded_at[0]
    later = [r for r in requests if r.custom_id not in first_ids]
    encoded = [backend.prepare(r).payload[1] for r in later]
    started = [i for i, fw in enumerate(recorder.seen) if any(_prefilled(fw, ids) for ids in encoded)]
    assert started and started[0] < first_done, "no later batch started before the first was done"

    def alone(r: Request) -> str:
        [body] = backend.run([backend.prepare(r)])
        return str(body["text"])

    assert got == {r.custom_id: alone(r) for r in requests}


def test_a_backend_that_is_not_the_engine_gets_the_one_batch_at_a_time_pool() -> None:
    class Fake:
        def prepare(self, request: Request) -> Any:
            raise AssertionError

        def run(self, batch: list[Any]) -> list[dict[str, Any]]:
            raise AssertionError

    assert isinstance(LocalExecutor(Fake(), 4).pool, InlinePool)  # type: ignore[arg-type]


def test_a_ray_actors_running_set_is_as_wide_as_the_batch_size_it_is_given() -> None:
    from celeris_cli.batch.ray_pool import RayWorker

    worker = RayWorker({"model": None, "device": "cpu", "dtype": "float32"}, 1, batch_size=3)
    pool = worker.executor.pool
    assert isinstance(pool, RunningPool) and pool.live.max_batch == 3


def test_run_batches_halves_a_failing_batch_and_yields_each_batch_once_and_whole() -> None:
    """Three batches in flight, handed back out of order; a poison item's batch is halved until it fails
    alone, and every batch comes back once, with all of its items, the rest answered."""
    from celeris_cli.spool.backend import Prepared
    from celeris_cli.spool.pool import Done, run_batches

    class Pool:
        slots = 3

        def __init__(self) -> None:
            self.flight: dict[int, list[Prepared]] = {}
            self.most = self.tickets = 0

        def submit(self, batch: list[Prepared]) -> int:
            self.tickets += 1
            ticket = self.tickets
            self.flight[ticket] = batch
            self.most = max(self.most, len(self.flight))
            return ticket

        def wait(self) -> list[Done]:
            ticket = max(self.flight)  # the newest first: out of submission order
            batch = self.flight.pop(ticket)
            if any(p.request.prompt == "poison" for p in batch):
                return [Done(ticket, error=RuntimeError("boom"))]
            return [Done(ticket, bodies=[{"text": p.request.prompt} for p in batch])]

    prompts = [f"p{i}" for i in range(12)]
    prompts[7] = "poison"
    items = [Prepared(Request(f"r{i}", i + 1, p), None, 1) for i, p in enumerate(prompts)]
    batches = [items[i : i + 4] for i in range(0, 12, 4)]
    pool, bisects = Pool(), []
    got = list(run_batches(pool, batches, lambda event, **kw: bisects.append(kw["size"])))  # type: ignore[arg-type]
    assert pool.most == 3 and len(got) == 3  # three in flight; each batch once
    assert sorted(sorted(d.item.request.line for d in g) for g in got) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    failed = [d for g in got for d in g if d.body is None]
    assert [d.item.request.prompt for d in failed] == ["poison"] and failed[0].code == "engine_error"
    assert bisects == [4, 2]  # halved, then halved again, until it fails alone


def test_the_default_models_mixed_requests_answer_as_alone_with_no_fallback(caplog: pytest.LogCaptureFixture) -> None:
    """The issue's reproduction on the default model (`nemotron` in its running set): a long prompt asking for
    16 tokens beside short ones asking for 24 to 64, at temperatures 0.7 and 1: every answer is its answer alone,
    and the pool never falls back to one batch at a time."""
    long = "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。床前明月光，疑是地上霜。" * 3
    asks = [(long, 16, 1.0), ("床前明月光，", 24, 0.7), ("The river", 32, 1.0), ("白日依山尽，", 48, 0.7)]
    asks += [("To be, or not", 64, 1.0), ("红豆生南国，", 40, 1.0), ("Once upon", 56, 0.7), ("It was late", 24, 1.0)]
    requests = [
        Request(f"r{i}", i + 1, p, params={"gen_length": g, "temperature": t, "seed": i})
        for i, (p, g, t) in enumerate(asks)
    ]
    backend = EngineBackend(None, "cpu", "float32", 1, {})
    executor = LocalExecutor(backend, batch_size=3)
    assert isinstance(executor.pool, RunningPool)
    got: dict[str, str] = {}
    with caplog.at_level("WARNING"):
        for outcomes in executor.run(requests):
            for oc in outcomes:
                assert oc.body is not None, oc.message
                got[oc.request.custom_id] = oc.body["text"]
    assert executor.pool.live.kinds == {"seeded"}
    assert "running set failed" not in caplog.text

    def alone(r: Request) -> str:
        [body] = backend.run([backend.prepare(r)])
        return str(body["text"])

    assert got == {r.custom_id: alone(r) for r in requests}
    assert len(set(got.values())) > 4
