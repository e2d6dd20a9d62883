"""When the engine's running set raises, the queue decodes each of its batches again on its own (issue
42): it says so, as a warning with the exception and a `running_set_failed` event, and every request is
still answered. The fake is at the engine boundary: a running set that raises (`LiveRun`'s surface)."""

from __future__ import annotations

import json
import logging
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from celeris_cli.spool.backend import EngineBackend, Prepared
from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool
from celeris_cli.spool.formats import Request
from celeris_cli.spool.pool import RunningPool

from .spool_helpers import FakeBackend, drop, make_queue, outputs

FAULT = "index 1 is out of bounds for dimension 0 with size 1"


class BrokenLive:
    """A running set that admits every row and raises at its first answer, as one that writes past its
    cache does."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def accepts(self, params: Any) -> bool:
        return True

    def add(self, key: int, prompt: str, ids: list[int], params: Any, seed: Any) -> None:
        self.rows.append(key)

    @property
    def pending(self) -> int:
        return len(self.rows)

    def answers(self) -> Generator[tuple[int, Any], None, None]:
        raise IndexError(FAULT)
        yield  # a generator, as LiveRun.answers is


class BrokenEngine:
    def live(self, max_batch: int) -> BrokenLive:
        return BrokenLive()


class EngineWithBrokenRunningSet(EngineBackend):
    """The engine's backend with a broken running set; a batch on its own decodes with the fake model."""

    def __init__(self) -> None:  # no weights: the engine is the fake above
        self.engine = BrokenEngine()
        self.model = FakeBackend()

    def prepare(self, request: Request) -> Prepared:
        p = self.model.prepare(request)
        return Prepared(p.request, p.group, p.cost, (p.payload, [0], None))

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        return self.model.run([Prepared(p.request, p.group, p.cost, p.payload[0]) for p in batch])


def test_a_failing_running_set_is_logged_and_recorded_and_every_batch_still_answered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    drop(tmp_path, "a.txt", "one\ntwo\nthree\n")
    backend = EngineWithBrokenRunningSet()
    spool = Spool(load_config(make_queue(tmp_path, batch_size=2)), lambda: backend)
    with caplog.at_level(logging.WARNING, logger="celeris_cli.spool.pool"):
        assert spool.run(once=True) == 0
    [warning] = [r for r in caplog.records if "running set failed" in r.getMessage()]
    assert FAULT in warning.getMessage() and warning.exc_info is not None and warning.exc_info[0] is IndexError
    events = [json.loads(x) for x in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e["event"] == "running_set_failed"]
    assert FAULT in event["error"] and event["tickets"]
    assert [r["response"]["body"]["text"] for r in outputs(tmp_path)["a.txt.results.jsonl"]] == ["eno", "owt", "eerht"]
    assert sorted(map(len, backend.model.batches)) == [1, 2]  # each batch again on its own


def test_the_daemon_puts_the_engine_behind_a_running_pool(tmp_path: Path) -> None:
    from celeris_cli.spool.pool import as_pool

    assert isinstance(as_pool(EngineWithBrokenRunningSet(), None, 2), RunningPool)
