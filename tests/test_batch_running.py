"""`celeris batch` decodes through the queue's pool (`spool.pool.RunningPool` over the engine's running
set): the next batch's rows start while an earlier batch is still running, and every answer is the one its
request gets alone."""

from __future__ import annotations

from typing import Any

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
    return any(row[: len(prompt)] == prompt for row in forward)


def test_a_later_batch_starts_while_an_earlier_one_is_still_running_and_answers_as_alone() -> None:
    backend = EngineBackend(None, "cpu", "float32", 1, {"gen_length": 32})  # the default model
    executor = LocalExecutor(backend, batch_size=2)
    assert isinstance(executor.pool, RunningPool)
    model = backend.engine.model
    recorder = Recorder(model)
    backend.engine.model = recorder
    requests = [Request(f"r{i}", i + 1, p) for i, p in enumerate(PROMPTS)]
    yielded_at: list[tuple[int, list[str]]] = []  # (forwards so far, the batch's custom ids)
    got: dict[str, str] = {}
    for outcomes in executor.run(requests):
        yielded_at.append((len(recorder.seen), [oc.request.custom_id for oc in outcomes]))
        for oc in outcomes:
            assert oc.body is not None, oc.message
            got[oc.request.custom_id] = oc.body["text"]
    backend.engine.model = model
    assert len(yielded_at) == 3 and all(len(ids) == 2 for _, ids in yielded_at)  # three batches of two

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
