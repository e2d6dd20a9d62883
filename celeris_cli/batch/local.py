"""Running requests on an in-process engine: prepare each (a bad one becomes its failure), pack the rest
into batches by settings and length, decode them through the pool the queue daemon uses (the engine's
running set, `spool.pool.RunningPool`: rows of the next batches join as rows of the last ones finish); a
failing batch is bisected so one poison request fails alone (`spool.pool.run_batches`, the daemon's
`batching.settle`). Also what each Ray actor runs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CelerisError
from ..spool.backend import Backend, Prepared
from ..spool.batching import pack_by_group
from ..spool.formats import Request
from ..spool.pool import as_pool, run_batches
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
    packing every executor uses (on Ray, the driver packs and each actor decodes whole batches): a batch
    of settings the running set cannot take decodes as it is, with the same batch mates local or on Ray."""
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
        self.pool = as_pool(backend, None, batch_size)

    def run(self, requests: list[Request], done: frozenset[int] = frozenset()) -> Iterator[list[Outcome]]:
        batches, failed = prepare_and_pack(self.pool.prepare, requests, self.batch_size, self.token_budget)
        failed, batches = skip_done(failed, batches, done)
        if failed:
            yield failed
        yield from self.decode(batches)

    def decode(self, batches: list[list[Prepared]]) -> Iterator[list[Outcome]]:
        """Packed batches, each batch's outcomes once all of it is decided."""
        for decided in run_batches(self.pool, batches, _log):
            yield [Outcome(d.item.request, d.body, d.code or None, d.message or None, d.retryable) for d in decided]
