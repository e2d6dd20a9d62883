"""`celeris batch`'s progress: it counts answers (results and failures, not batches), its total is every line
of the input from the first line it prints, its rate is answers per second, and its ETA is near the real
remaining time. A fake engine whose every answer takes a fixed time drives a fake clock: nothing sleeps."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

from celeris_cli.batch import run_file
from celeris_cli.batch.local import LocalExecutor
from celeris_cli.cli.progress import Progress
from celeris_cli.spool.backend import Prepared

from .spool_helpers import FakeBackend

PER_ANSWER_S = 7.5
LINE = re.compile(r"batch: (\d+)/(\d+) answers, ([\d.e-]+) answers/s, (\d+)s, eta (\d+)s")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TimedBackend(FakeBackend):
    """Each answer takes PER_ANSWER_S on the fake clock."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        self.clock.now += PER_ANSWER_S * len(batch)
        return super().run(batch)


def requests(path: Path, good: int, bad: int) -> None:
    lines = [json.dumps({"id": f"q{i}", "prompt": f"prompt {i}"}) for i in range(good)]
    for k in range(bad):  # not requests: each fails as its own record, an answer too
        lines.insert(10 + 40 * k, '{"id": "broken", "prompt": ')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_with_progress(tmp_path: Path, good: int, bad: int, batch_size: int = 16) -> list[tuple[int, ...]]:
    clock, out = Clock(), io.StringIO()
    requests(tmp_path / "in.jsonl", good, bad)
    executor = LocalExecutor(TimedBackend(clock), batch_size)
    with Progress(0, quiet=False, every_s=0.0, stream=out, label="batch", clock=clock) as progress:
        report = run_file(tmp_path / "in.jsonl", tmp_path / "o.jsonl", tmp_path / "f.jsonl", executor, progress.report)
    assert (report.results, report.failures) == (good, bad)
    shown = out.getvalue().splitlines()
    parsed = [LINE.fullmatch(line) for line in shown]
    assert shown and all(parsed), shown
    return [(int(m[1]), int(m[2]), float(m[3]), int(m[4]), int(m[5])) for m in parsed if m]


def test_progress_counts_answers_of_every_line_with_a_total_fixed_from_the_start(tmp_path: Path) -> None:
    lines = run_with_progress(tmp_path, good=300, bad=3)
    assert {total for _, total, *_ in lines} == {303}  # good and bad lines, the same from the first line on
    done = [d for d, *_ in lines]
    assert done == sorted(done) and done[-1] > 280  # answers, not batches (20 of them)
    assert all(abs(rate - 1 / PER_ANSWER_S) < 0.02 for d, _, rate, *_ in lines if d > 30)  # answers per second


def test_eta_is_within_a_factor_of_two_of_the_time_left_after_a_fifth(tmp_path: Path) -> None:
    lines = run_with_progress(tmp_path, good=300, bad=3)
    late = [(done, total, eta) for done, total, _, _, eta in lines if done >= total / 5]
    assert len(late) > 10
    for done, total, eta in late:
        left = (total - done) * PER_ANSWER_S  # the bad lines cost nothing, so this errs long, not short
        assert left / 2 <= eta <= left * 2, (done, eta, left)


def test_a_resumed_run_counts_the_journaled_answers_but_not_in_its_rate(tmp_path: Path) -> None:
    clock, out = Clock(), io.StringIO()
    with Progress(0, quiet=False, every_s=0.0, stream=out, label="batch", clock=clock) as progress:
        progress.report(100, 200)  # the journal had 100 finished
        for done in range(110, 200, 10):
            clock.now += 10 * PER_ANSWER_S
            progress.report(done, 200)
    first, *rest = [LINE.fullmatch(line) for line in out.getvalue().splitlines()]
    assert first is not None and (first[1], first[2]) == ("120", "200")  # the rate from the first answers on
    assert abs(float(first[3]) - 1 / PER_ANSWER_S) < 0.02 and int(first[5]) == 80 * PER_ANSWER_S


def test_the_eta_does_not_count_the_pipelines_filling_as_slowness() -> None:
    """Five batches decode together: the first finishes only after 100 s, then one every 20 s."""
    clock, out = Clock(), io.StringIO()
    with Progress(0, quiet=False, every_s=0.0, stream=out, label="batch", clock=clock) as progress:
        progress.report(0, 160)
        clock.now += 100.0
        for done in range(16, 161, 16):
            progress.report(done, 160)
            clock.now += 20.0
    for m in map(LINE.fullmatch, out.getvalue().splitlines()):
        assert m is not None
        done, eta = int(m[1]), int(m[5])
        left = (160 - done) / 16 * 20.0
        assert done < 160 / 5 or left / 2 <= eta <= left * 2, (done, eta, left)


def test_a_terminals_bar_shows_an_eta_from_the_second_batch_on() -> None:
    """The bar's eta is this run's own estimate (Rich's needs many updates within its last 30 s, and a
    run whose batches take longer showed `-:--:--` throughout): none before the pace is known, then the
    time left at that pace."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock, out = Clock(), Terminal()
    with Progress(0, quiet=False, stream=out, label="batch", clock=clock) as progress:
        assert progress._bar is not None
        progress.report(0, 160)
        clock.now += 100.0
        progress.report(16, 160)  # the first batch: the pipeline filling, not the pace
        progress._bar.refresh()
        assert "eta -:--:--" in out.getvalue()
        clock.now += 40.0
        progress.report(32, 160)  # 16 answers in 40 s: 128 left take 320 s
        out.truncate(0)
        progress._bar.refresh()
        assert "eta 0:05:20" in out.getvalue()
