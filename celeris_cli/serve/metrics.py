"""`/metrics`: the server's own Prometheus registry (prometheus_client), text format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "celeris_serve_requests",
            "Requests answered, by route template and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "celeris_serve_request_seconds",
            "Time from a completion request's arrival to its last byte",
            ["route"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.output_tokens = Counter("celeris_serve_output_tokens", "Completion tokens generated", registry=r)
        self.prompt_tokens = Counter("celeris_serve_prompt_tokens", "Prompt tokens read", registry=r)
        self.batch_rows = Histogram(
            "celeris_serve_batch_rows",
            "Rows decoded together: in one static batch, or in the running set as each of its rows finished",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.in_flight = Gauge(
            "celeris_serve_requests_in_flight", "Completion requests waiting or decoding", registry=r
        )
        self.dropped = Counter(
            "celeris_serve_rows_dropped", "Rows dropped before decoding: their client left", registry=r
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)
