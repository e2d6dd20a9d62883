"""The runner: one worker thread owns the engine (it is not thread-safe, and decoding holds the CPU).

HTTP handlers `prepare` a request (validation, in the caller's thread: no decoding), then `submit` it and
await its future. The worker takes every row that is waiting (up to `max_batch`), drops the rows whose
client has gone (their futures were cancelled), groups the rest by their final settings (each row's
script preset applied as it was prepared, exactly as the queue prepares its rows) and decodes each group
as one batch, each row with its own seed: an answer depends on its request alone (float32 on CPU is
batch-invariant; see tests/test_knobs.py). A batch that raises is halved until the row at fault fails
alone. `stream` is `submit` with a callback that sees the row's committed text after each block.

This is the interface the continuous scheduler (issue #30) can take over: routes only call
`prepare`, `submit` and `stream`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..decode.strategies import BY_BLOCK
from ..spool.backend import Prepared, Preparer
from ..spool.formats import Request

log = logging.getLogger(__name__)

OnText = Callable[[str], None]  # the row's committed text so far (stop strings and tokens cut)


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    batch_size: int  # rows decoded together with this one


@dataclass
class Row:
    prepared: Prepared
    future: Future[Answer] = field(default_factory=Future)
    on_text: OnText | None = None


class Runner:
    def __init__(self, engine: Any, generation: dict[str, Any] | None = None, max_batch: int = 16) -> None:
        self.engine = engine
        self.base = engine.params(generation or {})
        self.preparer = Preparer(engine.tokenizer, engine.max_length, self.base, engine.arch, engine.by_script)
        self.max_batch = max_batch
        self.waiting: queue.Queue[Row | None] = queue.Queue()
        self.on_batch: Callable[[int], None] | None = None  # rows in each decoded batch (metrics)
        self._thread = threading.Thread(target=self._loop, name="celeris-runner", daemon=True)
        self._thread.start()

    # -- the interface the routes use ----------------------------------------------------------------
    def prepare(self, request: Request) -> Prepared:
        """Validate a request and encode its prompt; raises CelerisError (a 400) for one that can never run."""
        return self.preparer.prepare(request)

    def submit(self, rows: list[Prepared]) -> list[Future[Answer]]:
        """Queue rows for decoding. Cancelling a future before its batch starts drops the row."""
        queued = [Row(p) for p in rows]
        for row in queued:
            self.waiting.put(row)
        return [row.future for row in queued]

    def stream(self, row: Prepared, on_text: OnText) -> Future[Answer]:
        """As `submit`, and `on_text` (called from the worker thread) sees the committed text after each
        block, for strategies that commit by block; others call it never (the answer comes whole)."""
        queued = Row(row, on_text=on_text)
        self.waiting.put(queued)
        return queued.future

    @property
    def depth(self) -> int:
        return self.waiting.qsize()

    def close(self) -> None:
        self.waiting.put(None)
        self._thread.join(timeout=30)

    # -- the worker ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            first = self.waiting.get()
            if first is None:
                return
            taken = [first]
            while len(taken) < self.max_batch:
                try:
                    row = self.waiting.get_nowait()
                except queue.Empty:
                    break
                if row is None:
                    self.waiting.put(None)  # stop after this round
                    break
                taken.append(row)
            live = [row for row in taken if row.future.set_running_or_notify_cancel()]  # gone clients drop out
            groups: dict[Any, list[Row]] = {}
            for row in live:
                groups.setdefault(row.prepared.group, []).append(row)
            for rows in groups.values():
                self._run(rows)

    def _run(self, rows: list[Row]) -> None:
        try:
            answers = self._decode(rows)
        except Exception as e:  # noqa: BLE001 - one request's failure must not sink its batch mates
            if len(rows) > 1:
                mid = len(rows) // 2
                self._run(rows[:mid])
                self._run(rows[mid:])
                return
            log.warning("decoding failed: %s: %s", type(e).__name__, e)
            rows[0].future.set_exception(e)
            return
        for row, answer in zip(rows, answers):
            row.future.set_result(answer)

    def _decode(self, rows: list[Row]) -> list[Answer]:
        params = rows[0].prepared.group  # final: the row's preset was applied as it was prepared
        texts_ids_seeds = [row.prepared.payload for row in rows]
        encoded = [ids for _, ids, _ in texts_ids_seeds]
        seeds = [seed for _, _, seed in texts_ids_seeds]
        hook = None
        if params.strategy in BY_BLOCK and any(row.on_text for row in rows):

            def hook(b: int, ids: list[int]) -> None:
                on_text = rows[b].on_text
                if on_text is not None:
                    on_text(self.engine.finish(ids, params.stop, encoded[b])[0])

        outs, _ = self.engine.decode_ids(encoded, params, seeds, on_block=hook)
        if self.on_batch is not None:
            self.on_batch(len(rows))
        answers = []
        for ids_in, out in zip(encoded, outs):
            text, n_out, reason = self.engine.finish(out, params.stop, ids_in)
            answers.append(Answer(text, reason, len(ids_in), n_out, len(rows)))
        return answers
