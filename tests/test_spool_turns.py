"""Fair claims (issue 46 item 3): a small file arriving beside or behind big ones is claimed and answered
before they finish, its rows in the running set within a turn or two, over a fake slow model that records
the order of its batches."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool

from .spool_helpers import FakeBackend, drop, make_queue, outputs

BIG = 100


class SlowModel(FakeBackend):
    """The fake model, slow in turns: each batch is one tick of a clock, and at a given tick a file
    arrives (a user's file dropped while the queue decodes)."""

    def __init__(self, arrivals: dict[int, Callable[[], Any]] | None = None) -> None:
        super().__init__()
        self.arrivals = arrivals or {}

    def run(self, batch):  # type: ignore[no-untyped-def]
        tick = len(self.batches)
        if tick in self.arrivals:
            self.arrivals[tick]()
        return super().run(batch)


def files_of(model: SlowModel) -> list[set[str]]:
    """The files each batch served, in order (a custom_id is `line-N`; the files come from the events)."""
    return [set(b) for b in model.batches]


def published_order(root: Path) -> list[str]:
    events = [json.loads(x) for x in (root / "logs" / "events.jsonl").read_text().splitlines()]
    return [e["file"] for e in events if e["event"] == "published"]


def big_files(root: Path, ages: tuple[float, ...] = (40, 30, 20), lines: int = BIG) -> None:
    for n, age in enumerate(ages, start=1):
        drop(root, f"big{n}.txt", "".join(f"big {n} prompt {i}\n" for i in range(lines)), age_s=age)


def batches_of(root: Path, name: str) -> list[int]:
    events = [json.loads(x) for x in (root / "logs" / "events.jsonl").read_text().splitlines()]
    batches = [e for e in events if e["event"] == "batch"]
    return [i for i, e in enumerate(batches) if name in e["files"]]


def test_a_one_line_file_dropped_beside_three_big_ones_is_answered_before_they_finish(tmp_path: Path) -> None:
    big_files(tmp_path)
    drop(tmp_path, "hi.txt", "hello there\n", age_s=10)  # the newest of the four
    model = SlowModel()
    spool = Spool(load_config(make_queue(tmp_path, batch_size=16)), lambda: model)
    assert spool.run(once=True) == 0
    [turn] = batches_of(tmp_path, "hi.txt")
    assert turn <= 3, turn  # at most one batch of each big file first (they came first)
    assert len(model.batches) >= 3 * BIG // 16
    assert published_order(tmp_path)[0] == "hi.txt"
    assert [r["response"]["body"]["text"] for r in outputs(tmp_path)["hi.txt.results.jsonl"]] == ["ereht olleh"]


def test_a_one_line_file_arriving_while_big_files_decode_gets_the_next_turn_or_the_one_after(tmp_path: Path) -> None:
    big_files(tmp_path)
    model = SlowModel({4: lambda: drop(tmp_path, "hi.txt", "hello there\n")})  # during the fifth batch
    spool = Spool(load_config(make_queue(tmp_path, batch_size=16)), lambda: model)
    assert spool.run(once=True) == 0
    [turn] = batches_of(tmp_path, "hi.txt")
    assert 5 <= turn <= 6, turn  # the batch after the one it arrived in, or the next
    assert published_order(tmp_path)[0] == "hi.txt"
    total = len(model.batches)
    assert total >= 3 * BIG // 16 and turn < total // 2


def test_big_files_take_turns_instead_of_one_finishing_first(tmp_path: Path) -> None:
    big_files(tmp_path, ages=(40, 30), lines=150)  # one is a round's budget: the other is claimed meanwhile
    model = SlowModel()
    spool = Spool(load_config(make_queue(tmp_path, batch_size=16)), lambda: model)
    assert spool.run(once=True) == 0
    first, second = batches_of(tmp_path, "big1.txt"), batches_of(tmp_path, "big2.txt")
    assert first[:3] == [0, 2, 4] and second[:3] == [1, 3, 5]  # rows of each file started in turn


class ThreeSlots:
    """A pool of three slots over the fake model (as the engine's running set has): it runs every batch
    in flight when asked to wait, and keeps what was in flight at each submit."""

    slots = 3

    def __init__(self) -> None:
        self.model = FakeBackend()
        self.pending: list[tuple[int, list[Any]]] = []
        self.beside: list[tuple[list[str], int]] = []  # (a batch's ids, batches in flight beside it)

    def prepare(self, request: Any) -> Any:
        return self.model.prepare(request)

    def submit(self, batch: list[Any]) -> int:
        ticket = len(self.beside) + 1
        self.beside.append(([p.request.custom_id for p in batch], len(self.pending)))
        self.pending.append((ticket, batch))
        return ticket

    def wait(self) -> list[Any]:
        from celeris_cli.spool.pool import Done

        done = [Done(t, bodies=self.model.run(b)) for t, b in self.pending]
        self.pending = []
        return done

    def close(self) -> None:
        pass


def test_suspects_are_tested_together_with_nothing_else_in_flight(tmp_path: Path) -> None:
    """Lines 1-3 were in flight when the daemon died: one group, tested in batches of its own lines only
    (batch_size 2: two tests), each with nothing in flight before or beside it."""
    config = make_queue(tmp_path, batch_size=2)
    work = tmp_path / "batch_inputs" / ".work"
    (work / "journal").mkdir(parents=True)
    (work / "00000001.s.txt").write_text("a\nb\nc\nd\ne\n")  # claimed when the daemon died...
    (work / "journal" / "00000001.jsonl").write_text('{"try": [1, 2, 3]}\n')  # ...with lines 1-3 in flight
    big_files(tmp_path, ages=(40,), lines=8)
    pool = ThreeSlots()
    assert Spool(load_config(config), lambda: pool).run(once=True) == 0
    tests = pool.beside[:2]  # suspects go first (the big file's ids are line-N too: told apart by order)
    assert sorted(x for ids, _ in tests for x in ids) == ["line-1", "line-2", "line-3"]
    assert all(beside == 0 for _, beside in pool.beside[:3])  # nothing before, beside or after them at once
    assert max(beside for _, beside in pool.beside) == 2  # other batches share the pool three at a time
    assert len(outputs(tmp_path)["s.txt.results.jsonl"]) == 5
