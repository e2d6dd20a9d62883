"""Answering prepared prompts: each checked up front (a bad file line is named and skipped), then decoded
and written in input order: through one running set that admits the next prompt as each row finishes
(where the settings allow it, `Engine.continuous`), each answer written once every answer before it is;
otherwise batch by batch, each batch written as soon as it finishes."""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import typer

from ..errors import CelerisError, UsageError
from ..params import MAX_SEED
from .app import fail
from .output import Sink
from .progress import Progress, deferred_interrupt, interrupt_code, interrupted
from .prompts import BadLine, Prompt


@dataclass(frozen=True)
class Job:
    """One answer to produce: a prompt, its token ids (checked to fit) and its seed."""

    text: str
    ids: list[int]
    seed: int
    sample: int = 0  # which of the prompt's --samples this is


def template_options(text: str | None) -> dict[str, Any] | None:
    """--chat-template-kwargs: a JSON object, or None when not given."""
    if text is None:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--chat-template-kwargs: not valid JSON ({e})") from None
    if not isinstance(options, dict):
        raise UsageError("--chat-template-kwargs: must be a JSON object, such as '{\"enable_thinking\": false}'")
    return options


def prepare(
    engine: Any,
    params: Any,
    prompts: list[Prompt],
    bad: list[BadLine],
    chat: bool,
    strict: bool,
    samples: int,
    chat_options: dict[str, Any] | None = None,
) -> tuple[list[Job], int]:
    """Encode and check every prompt before any decoding. A bad argument fails the run; a bad file line is
    reported and skipped (with --strict it fails the run too, naming the line)."""
    problems = [(b.line, f"{b.source}:{b.line}", b.error) for b in bad]
    ok: list[tuple[Prompt, list[int]]] = []
    for p in prompts:
        try:
            ids = engine.encode_prompt(p.text, chat, chat_options)
            engine.check_fits(len(ids), params)
        except UsageError as e:
            if p.line is None:
                raise
            problems.append((p.line, p.where, e))
            continue
        ok.append((p, ids))
    problems.sort(key=lambda problem: problem[0])
    if problems and strict:
        _, where, err = problems[0]
        raise type(err)(f"{where}: {err}" + (f" (and {len(problems) - 1} more bad lines)" if len(problems) > 1 else ""))
    for _, where, err in problems:
        typer.echo(f"Error: {where}: {err} (skipped)", err=True)
    if params.seed + samples - 1 > MAX_SEED:
        raise UsageError(f"seed {params.seed} plus {samples} samples passes the largest seed {MAX_SEED}")
    jobs = [Job(p.text, ids, params.seed + k, k) for p, ids in ok for k in range(samples)]
    return jobs, len(problems)


def run(engine: Any, params: Any, jobs: list[Job], batch_size: int, sink: Sink, quiet: bool) -> int:
    """Decode and write every job in input order; returns how many answers ended with an `error` (a
    constraint the answer could not complete). An answer depends only on its prompt, settings and seed,
    so the running set and input-order batches give the same answers as any other packing."""
    written = _Written(sink, len(jobs), quiet)
    t0 = time.perf_counter()
    try:
        with written.progress:
            final = [engine.params_for(j.text, params) for j in jobs]
            if jobs and all(engine.continuous(p) for p in final):
                texts, ids, seeds = [j.text for j in jobs], [j.ids for j in jobs], [j.seed for j in jobs]
                engine.decode_running(texts, ids, final, seeds, batch_size, written.one)
            else:
                for start in range(0, len(jobs), batch_size):
                    batch = jobs[start : start + batch_size]
                    results = engine.decode_batch(
                        [j.text for j in batch], [j.ids for j in batch], params, [j.seed for j in batch]
                    )
                    written.many(results)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`sigterm_interrupts`)
        with deferred_interrupt():
            sink.close()
        typer.echo(f"{interrupted(e)}: {sink.written} of {len(jobs)} answers written", err=True)
        raise typer.Exit(interrupt_code(e)) from None
    except CelerisError as e:  # finished answers are kept, as on an interrupt
        sink.close()
        fail(e)
    sink.close()
    seconds = time.perf_counter() - t0
    tokens, last = written.tokens, written.last
    if not quiet and last is not None:
        prompts = sum(j.sample == 0 for j in jobs)
        answers = f", {sink.written} answers" if sink.written != prompts else ""
        typer.echo(
            f"[{prompts} prompt(s){answers}, {tokens} tokens in {seconds:.2f}s, "
            f"{tokens / max(seconds, 1e-9):.1f} tokens/s, {last.device} {last.dtype}]"
            + (f" -> {sink.path}" if sink.path else ""),
            err=True,
        )
    return written.errors


class _Written:
    """Results written in input order, each record whole (an interrupt never splits one), with progress."""

    def __init__(self, sink: Sink, total: int, quiet: bool) -> None:
        self.sink, self.progress = sink, Progress(total, quiet)
        self.held: dict[int, Any] = {}  # finished out of order, waiting for those before them
        self.count = self.tokens = self.errors = 0
        self.last: Any = None

    def one(self, index: int, result: Any) -> None:
        self.held[index] = result
        ready: list[Any] = []
        while self.count + len(ready) in self.held:
            ready.append(self.held.pop(self.count + len(ready)))
        if ready:
            self.many(ready)

    def many(self, results: list[Any]) -> None:
        with deferred_interrupt(), self.progress.hidden() if self.sink.on_terminal else nullcontext():
            self.sink.write([r.to_dict() for r in results])  # a record is written whole or not at all
        self.count += len(results)
        self.tokens += sum(r.output_tokens for r in results)
        self.errors += sum(1 for r in results if getattr(r, "error", None))
        self.last = results[-1]
        self.progress.advance(len(results), self.tokens)
