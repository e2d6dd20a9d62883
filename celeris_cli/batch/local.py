"""Running requests on an in-process engine: prepare each (a bad one becomes its failure), pack the rest
into batches by settings and length, decode. Also what each Ray actor runs on its share."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ..errors import CelerisError
from ..spool.backend import Backend, Prepared
from ..spool.formats import Request
from ..spool.packing import pack
from . import Outcome

log = logging.getLogger(__name__)


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
                yield Outcome(req, code="engine_error", message=f"{type(e).__name__}: {e}", retryable=False)
        for batch in pack(prepared, lambda p: p, self.batch_size, self.token_budget):
            yield from self.run_batch(batch)

    def run_batch(self, batch: list[Prepared]) -> Iterator[Outcome]:
        """Decode a batch; if it fails, halve it until the failing requests are alone, so one poison
        request fails by itself and its batch mates are served (their answers do not depend on it)."""
        try:
            bodies = self.backend.run(batch)
        except Exception as e:
            if len(batch) == 1:
                log.exception("request %s failed", batch[0].request.custom_id)
                yield Outcome(batch[0].request, code="engine_error", message=_describe(e), retryable=True)
                return
            half = len(batch) // 2
            yield from self.run_batch(batch[:half])
            yield from self.run_batch(batch[half:])
            return
        for p, body in zip(batch, bodies):
            yield Outcome(p.request, body=body)


def _describe(e: Exception) -> Any:
    return f"{type(e).__name__}: {e}"
