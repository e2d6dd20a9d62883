"""What every route shares: the runner, the stores, the limits, the keys and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .batches import BatchStore
from .files import FileStore
from .metrics import ServeMetrics
from .runner import Answer, Runner
from .settings import Keys, Limits


@dataclass
class ServeState:
    runner: Runner
    model_id: str
    limits: Limits
    keys: Keys
    files: FileStore | None = None  # None: no queue config, no Files and Batch API
    batches: BatchStore | None = None  # None: no queue config, no Batch API
    queue: Any = None  # the queue's BatchConfig, for /health
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    in_flight: int = 0  # completion requests waiting or decoding (changed on the event loop only)
    created: int = 0  # /v1/models' `created`: the model folder's time, the same on every request
    threads: int = 0  # torch threads decoding (--threads), shown by /health
    hosts: frozenset[str] = frozenset()  # Host and Origin names accepted beside loopback (`guard.Guard`)

    def begin(self, n: int = 1) -> None:
        self.in_flight += n
        self.metrics.in_flight.set(self.in_flight)

    def end(self, n: int = 1) -> None:
        self.in_flight -= n
        self.metrics.in_flight.set(self.in_flight)

    def count(self, route: str, answer: Answer, seconds: float) -> None:
        """An answer's figures (the request itself is counted by its status, in `guard.Guard`)."""
        self.metrics.latency.labels(route).observe(seconds)
        self.metrics.output_tokens.inc(answer.completion_tokens)
        self.metrics.prompt_tokens.inc(answer.prompt_tokens)
