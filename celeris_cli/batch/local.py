"""Running requests on an in-process engine: prepare each (a bad one becomes its failure), pack the rest
into batches by settings and length, decode; a failing batch is bisected so one poison request fails
alone. The queue's own packing and bisection (`spool.batching`). Also what each Ray actor runs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CelerisError
from ..spool.backend import Backend, Prepared
from ..spool.batching import pack_by_group, run_bisecting
from ..spool.formats import Request
from . import Outcome

log = logging.getLogger(__name__)


def _same(p: Prepared) -> Prepared:
    return p


def _log(event: str, **fields: Any) -> None:
    log.info("%s %s", event, fields)


def prepare_and_pack(
    prepare: Callable[[Request], Prepared], requests: list[Request], batch_size: int, token_budget: int
) -> tuple[list[list[Prepared]], list[Outcome]]:
    """The batches the requests are decoded in, and the failures of those that cannot be prepared. The one
    packing every executor uses (on Ray, the driver packs and each actor decodes whole batches), so an
    answer's batch mates, and with them its low-precision rounding, are the same local or on Ray."""
    prepared: list[Prepared] = []
    failed: list[Outcome] = []
    for req in requests:
        try:
            prepared.append(prepare(req))
        except CelerisError as e:
            failed.append(Outcome(req, code=e.code, message=str(e), retryable=e.retryable))
        except Exception as e:  # a request the engine cannot even prepare must not sink the others
            log.exception("preparing %s", req.custom_id)
            failed.append(Outcome(req, code="engine_error", message=f"{type(e).__name__}: {e}"))
    return pack_by_group(prepared, _same, batch_size, token_budget), failed


def skip_done(
    failed: list[Outcome], batches: list[list[Prepared]], done: frozenset[int]
) -> tuple[list[Outcome], list[list[Prepared]]]:
    """What is left after an earlier run finished the lines in `done`: the packing is that of all the
    requests, so each batch left has the batch mates it had in an uninterrupted run. Batches are
    journaled whole, so a batch is done entirely or not at all."""
    left = [oc for oc in failed if oc.request.line not in done]
    return left, [b for b in batches if not all(p.request.line in done for p in b)]


class LocalExecutor:
    def __init__(self, backend: Backend, batch_size: int = 16, token_budget: int = 16384) -> None:
        self.backend = backend
        self.batch_size = batch_size
        self.token_budget = token_budget

    def run(self, requests: list[Request], done: frozenset[int] = frozenset()) -> Iterator[list[Outcome]]:
        batches, failed = prepare_and_pack(self.backend.prepare, requests, self.batch_size, self.token_budget)
        failed, batches = skip_done(failed, batches, done)
        if failed:
            yield failed
        for batch in batches:
            yield list(self.decode(batch))

    def decode(self, batch: list[Prepared]) -> Iterator[Outcome]:
        """One packed batch; a failing batch is bisected so a poison request fails alone."""
        for d in run_bisecting(self.backend, batch, _same, None, lambda: False, _log):
            yield Outcome(d.item.request, d.body, d.code or None, d.message or None, d.retryable)
