"""Prometheus metrics as a text file (`metrics_textfile:` in batch.yaml), for node_exporter's textfile
collector: written with prometheus_client's `write_to_textfile` (a temp file, then a rename).
Counters count since the daemon started; Prometheus' rate() handles the reset at a restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

MIN_INTERVAL_S = 1.0  # at most one write a second, plus one at the stop


class Metrics:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.written = 0.0
        if path is None:
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge

        r = self.registry = CollectorRegistry()
        self.done = Counter("celeris_queue_requests_done", "Requests with a published result", registry=r)
        self.failed = Counter("celeris_queue_requests_failed", "Failure records, by code", ["code"], registry=r)
        self.batches = Counter("celeris_queue_batches", "Batches decoded", registry=r)
        self.tokens = Counter("celeris_queue_output_tokens", "Output tokens decoded", registry=r)
        self.tok_s = Gauge("celeris_queue_tokens_per_second", "Output tokens per second, last batch", registry=r)
        self.peak = Gauge("celeris_queue_peak_memory_bytes", "Peak memory of the last batch", registry=r)
        self.depth = Gauge("celeris_queue_depth", "Files waiting in the inbox", registry=r)
        self.claimed = Gauge("celeris_queue_claimed", "Files claimed and not yet published", registry=r)
        self.oldest = Gauge("celeris_queue_oldest_pending_age_seconds", "Age of the oldest inbox file", registry=r)
        self.last_ok = Gauge("celeris_queue_last_success_timestamp_seconds", "Last published result", registry=r)

    def batch(self, output_tokens: int, wall_s: float, peak_memory_mb: float = 0.0) -> None:
        if self.path is not None:
            self.peak.set(peak_memory_mb * 2**20)
            self.batches.inc()
            self.tokens.inc(output_tokens)
            self.tok_s.set(output_tokens / wall_s if wall_s > 0 else 0.0)

    def published(self, results: int, failure_codes: list[str]) -> None:
        if self.path is not None:
            self.done.inc(results)
            for code in failure_codes:
                self.failed.labels(code=code).inc()
            if results:
                self.last_ok.set(time.time())

    def queue(self, depth: int, oldest_mtime: float | None, claimed: int) -> None:
        if self.path is not None:
            self.depth.set(depth)
            self.claimed.set(claimed)
            self.oldest.set(time.time() - oldest_mtime if oldest_mtime is not None else 0.0)

    def write(self, force: bool = False) -> None:
        if self.path is None or (not force and time.monotonic() - self.written < MIN_INTERVAL_S):
            return
        from prometheus_client import write_to_textfile

        try:
            write_to_textfile(str(self.path), self.registry)
            self.path.chmod(0o644)  # counts only, for node_exporter (another user): not private as the queue is
        except OSError:
            pass  # metrics must never stop the queue
        self.written = time.monotonic()


def peak_memory_mb(body: dict[str, Any]) -> float:
    timing = body.get("timing")
    return float(timing.get("peak_memory_mb", 0.0)) if isinstance(timing, dict) else 0.0


def output_tokens(body: dict[str, Any]) -> int:
    usage = body.get("usage")
    return int(usage.get("completion_tokens", 0)) if isinstance(usage, dict) else 0
