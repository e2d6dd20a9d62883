"""The runner: one worker thread owns the engine (it is not thread-safe, and decoding holds the CPU).

HTTP handlers `prepare` a request (validation, in the caller's thread: no decoding), then `submit` it and
await its future. The worker decodes through the engine's running set (`Engine.live`): every waiting row
that can join (block diffusion or the fast strategy, without guidance) is added to it, and rows that
arrive while it runs join between two answers, as rows leave; each answer is handed back as its row
finishes. Rows whose client has gone before they join (their futures were cancelled) are dropped. Rows of
other settings (guidance, other strategies) are grouped by their final settings (each row's script preset
applied as it was prepared, exactly as the queue prepares its rows) and decoded as static batches, each row
with its own seed. Either way an answer depends on its request alone (float32 on CPU is batch-invariant;
see tests/test_knobs.py and tests/test_running.py). A row failing in the running set, or a static batch
that raises, is decoded again alone, so only the row at fault fails. `stream` is `submit` with a callback
that sees the row's committed text after each block.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..spool.backend import Prepared, Preparer
from ..spool.formats import Request
from ..strategy import STRATEGIES

log = logging.getLogger(__name__)

OnText = Callable[[str], None]  # the row's committed text so far (stop strings and tokens cut)


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    batch_size: int  # rows decoded together with this one (in a running set: in flight as it finished)


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
        # rows decoded together (metrics): each static batch's, and the running set's rows in flight as each
        # of its rows finishes
        self.on_batch: Callable[[int], None] | None = None
        self.live = engine.live(max_batch)
        self.live.on_block = self._on_block
        self.running: dict[int, Row] = {}  # rows in the running set, by key
        self.keys = itertools.count()
        self.stopping = False
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
            if not self.live.pending:  # idle: wait for a row
                if self.stopping:
                    return
                first = self.waiting.get()
                if first is None:
                    return
                self._take([first])
            self._take(self._arrived())
            if self.live.pending:
                self._decode_live()

    def _arrived(self) -> list[Row]:
        """The rows waiting now (none blocks); the stop sentinel ends the loop once the running set is done."""
        rows: list[Row] = []
        while True:
            try:
                row = self.waiting.get_nowait()
            except queue.Empty:
                return rows
            if row is None:
                self.stopping = True
                return rows
            rows.append(row)

    def _take(self, rows: list[Row]) -> None:
        """Rows join the running set where they can; the others decode now, in static batches by settings.
        Rows whose client has gone are dropped."""
        groups: dict[Any, list[Row]] = {}
        for row in rows:
            if not row.future.set_running_or_notify_cancel():
                continue
            params = row.prepared.group  # final: the row's preset was applied as it was prepared
            if self.live.accepts(params):
                key = next(self.keys)
                self.running[key] = row
                text, ids, seed = row.prepared.payload
                self.live.add(key, text, ids, params, seed)
            else:
                groups.setdefault(params, []).append(row)
        for group in groups.values():
            for i in range(0, len(group), self.max_batch):
                self._run(group[i : i + self.max_batch])

    def _decode_live(self) -> None:
        """Answers as rows finish; rows that arrive meanwhile join between two answers."""
        try:
            for key, result in self.live.answers():
                row = self.running.pop(key)
                beside = self.live.scheduler.in_flight if self.live.scheduler is not None else 1  # itself too
                if self.on_batch is not None:
                    self.on_batch(beside)
                if isinstance(result, BaseException):  # too large alone
                    row.future.set_exception(result)
                else:
                    row.future.set_result(
                        Answer(result.text, result.finish_reason, result.prompt_tokens, result.output_tokens, beside)
                    )
                self._take(self._arrived())
        except Exception as e:  # noqa: BLE001 - one row's failure must not sink the rows beside it
            log.warning("the running set failed (%s: %s); decoding its rows again, each alone", type(e).__name__, e)
            rows, self.running = list(self.running.values()), {}
            for row in rows:
                self._run([row])

    def _on_block(self, key: int, ids: list[int]) -> None:
        row = self.running.get(key)
        if row is not None and row.on_text is not None:
            params, encoded = row.prepared.group, row.prepared.payload[1]
            row.on_text(self.engine.finish(ids, params.stop, encoded)[0])

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
        if STRATEGIES[params.strategy].streams_blocks and any(row.on_text for row in rows):

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
