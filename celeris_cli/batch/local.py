"""Running requests on an in-process engine: prepare each (a bad one becomes its failure), pack the rest
into batches by settings and length, decode; a failing batch is bisected so one poison request fails
alone. The queue's own packing and bisection (`spool.batching`). Also what each Ray actor runs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
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


class LocalExecutor:
    def __init__(self, backend: Backend, batch_size: int = 16, token_budget: int = 16384) -> None:
        self.backend = backend
        self.batch_size = batch_size
        self.token_budget = token_budget

    def run(self, requests: list[Request]) -> Iterator[Outcome]:
        prepared: list[Prepared] = []
        for req in requests:
            try:
                prepared.append(self.backend.prepare(req))
            except CelerisError as e:
                yield Outcome(req, code=e.code, message=str(e), retryable=e.retryable)
            except Exception as e:  # a request the engine cannot even prepare must not sink the others
                log.exception("preparing %s", req.custom_id)
                yield Outcome(req, code="engine_error", message=f"{type(e).__name__}: {e}")
        for batch in pack_by_group(prepared, _same, self.batch_size, self.token_budget):
            for d in run_bisecting(self.backend, batch, _same, None, lambda: False, _log):
                yield Outcome(d.item.request, d.body, d.code or None, d.message or None, d.retryable)
