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

from ..backoff import run_backing_off
from ..constraints import MAX_SPEC_CHARS
from ..errors import UsageError
from ..params import check_fits, script_of
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
    logprobs: list[dict[str, Any]] | None = None  # `engine.Result.logprobs`, where the request asked
    error: str | None = None  # why a constrained answer ended unfinished (`engine.Outcome.error`)


@dataclass
class Row:
    prepared: Prepared
    future: Future[Answer] = field(default_factory=Future)
    on_text: OnText | None = None


class Runner:
    def __init__(
        self,
        engine: Any,
        generation: dict[str, Any] | None = None,
        max_batch: int = 16,
        max_constraint_chars: int = MAX_SPEC_CHARS,
    ) -> None:
        self.engine = engine
        self.max_constraint_chars = max_constraint_chars  # --max-constraint-chars
        self.base = engine.params(generation or {})
        self.preparer = Preparer.of(engine, self.base)
        self.max_batch = max_batch
        self.waiting: queue.Queue[Row | None] = queue.Queue()
        self.leaving: queue.Queue[Future[Answer]] = queue.Queue()  # rows whose client left (`drop`)
        # rows decoded together (metrics): each static batch's, and the running set's rows in flight as each
        # of its rows finishes
        self.on_batch: Callable[[int], None] | None = None
        self.live = engine.live(max_batch)
        self.live.before_round = self._leave  # a client that left frees its row at the next round
        self.live.on_block = self._on_block
        self.running: dict[int, Row] = {}  # rows in the running set, by key
        self.keys = itertools.count()
        self.stopping = False
        self._thread = threading.Thread(target=self._loop, name="celeris-runner", daemon=True)
        self._thread.start()

    # -- the interface the routes use ----------------------------------------------------------------
    def prepare(self, request: Request, ids: list[int] | None = None) -> Prepared:
        """Validate a request and encode its prompt (or take its token `ids` as given); raises CelerisError
        (a 400) for one that can never run. Called off the event loop: a long prompt takes a while, and a
        constraint is compiled here, under its budget, never on the decoding thread (`structured.grammar.check`)."""
        tok, p = self.engine.tokenizer, self.preparer
        params = p.base.with_(**request.params)
        constraint = params.structured_outputs
        if constraint is not None and len(constraint) > self.max_constraint_chars:
            raise UsageError(
                f"structured_outputs: at most {self.max_constraint_chars} characters of constraint on this server "
                f"(--max-constraint-chars), got {len(constraint)}"
            )
        if ids is None:
            return self.preparer.prepare(request)
        size = tok.backend.size()
        bad = next((t for t in ids if t >= size or t == tok.mask_id), None)
        if bad == tok.mask_id:
            raise UsageError(f"prompt: token id {bad} is this model's mask token, which a prompt may not hold")
        if bad is not None:
            raise UsageError(f"prompt: token id {bad} is past this model's vocabulary (ids 0 to {size - 1})")
        if p.arch is not None:
            p.arch.check_strategy(params.strategy)
        if params.subword_min_p > 0:
            tok.require_word_pieces()
        text = tok.decode(ids)
        preset = p.by_script.get(script_of(text) or "")
        params = params.under(preset) if preset else params  # as the queue's Preparer applies it
        check_fits(len(ids), params.gen_length, p.max_length)
        self.engine.check_structure(params)
        return Prepared(request, params.batch_key(), len(ids) + params.gen_length, (text, list(ids), params.seed))

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

    def drop(self, future: Future[Answer]) -> bool:
        """Free the row of a client that left: one not yet taken is dropped at once; one in the running set
        (waiting there or in flight) is dropped by the worker before its next answer (`LiveRun.cancel`),
        and its future is never resolved. False: the row is answered, or decoding in a static batch."""
        if future.cancel():
            return True
        if future.done():
            return False
        self.leaving.put(future)
        return True

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
        """The rows waiting now (none blocks); the stop sentinel ends the loop once the running set is done.
        Rows whose client left are taken out of the running set first."""
        self._leave()
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
                try:
                    self.live.add(key, text, ids, params, seed)
                except Exception as e:  # noqa: BLE001 - outside any decode (the memory estimate): the row fails, not the worker
                    log.warning("a row could not be planned: %s: %s", type(e).__name__, e)
                    self.live.cancel(key)
                    del self.running[key]
                    row.future.set_exception(e)
            else:
                groups.setdefault(params, []).append(row)
        for group in groups.values():
            for i in range(0, len(group), self.max_batch):
                self._run(group[i : i + self.max_batch])

    def _leave(self) -> None:
        gone: set[int] = set()
        while True:
            try:
                gone.add(id(self.leaving.get_nowait()))
            except queue.Empty:
                break
        for key in [k for k, row in self.running.items() if id(row.future) in gone]:
            self.live.cancel(key)
            del self.running[key]

    def _decode_live(self) -> None:
        """Answers as rows finish; rows that arrive meanwhile join between two answers."""
        try:
            for key, result in self.live.answers():
                row = self.running.pop(key)  # (a row dropped by `_leave` is never answered)
                beside = self.live.scheduler.in_flight if self.live.scheduler is not None else 1  # itself too
                if self.on_batch is not None:
                    self.on_batch(beside)
                if isinstance(result, BaseException):  # too large alone
                    row.future.set_exception(result)
                else:
                    row.future.set_result(
                        Answer(
                            result.text,
                            result.finish_reason,
                            result.prompt_tokens,
                            result.output_tokens,
                            beside,
                            result.logprobs,
                            result.error,
                        )
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
        """A static batch, backing off as the queue does (`backoff`): out of memory or any failure halves it
        down to one row; a row that does not fit alone is answered with `TooLarge` (a 400 naming what to
        lower), a row that fails alone with its own error, and its batch mates with their answers."""
        params, memory = rows[0].prepared.group, self.engine.memory
        try:
            outcomes = run_backing_off(
                self._decode,
                rows,
                lambda group: memory.need([row.prepared.payload[1] for row in group], params),
                memory.budget,
                release=memory.release,
                isolate=True,
            )
        except Exception as e:  # noqa: BLE001 - outside any decode (the memory estimate): the rows fail, not the worker
            log.warning("a batch could not be planned: %s: %s", type(e).__name__, e)
            for row in rows:
                row.future.set_exception(e)
            return
        for row, outcome in zip(rows, outcomes):
            if outcome.error is not None:
                row.future.set_exception(outcome.error)
            else:
                assert outcome.value is not None
                row.future.set_result(outcome.value)

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

        rules = [self.engine.rule_for(params) for _ in rows]  # each row's constraint and log-probability record
        outs, _ = self.engine.decode_ids(encoded, params, seeds, on_block=hook, rules=rules)
        if self.on_batch is not None:
            self.on_batch(len(rows))
        answers = []
        for ids_in, out, rule in zip(encoded, outs, rules):
            a = self.engine.outcome(out, params, ids_in, rule)
            answers.append(
                Answer(a.text, a.finish_reason, len(ids_in), a.output_tokens, len(rows), a.logprobs, a.error)
            )
        return answers
