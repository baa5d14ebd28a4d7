"""The activator's Prometheus metrics, registered on a registry the composition root hands in.

One `ActivatorMetrics` per registry, shared by every deployment's `Activator` (the series are
labelled by deployment); no module-level collectors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# LLM latencies span five orders of magnitude: a proxied first byte from a hot instance takes
# milliseconds, a cold start on vLLM a minute or more, a long generation several minutes.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


BANDS = ("high", "default", "low")


def band(priority: int) -> str:
    """The band of `stoker_queue_length_by_priority` a request of `priority` counts in."""
    return "high" if priority < 0 else "low" if priority > 0 else "default"


class ActivatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "stoker_requests_total",
            "Requests answered by the activator, by deployment and HTTP status (499: the client left).",
            ["deployment", "code"],
            registry=registry,
        )
        self.ttft = Histogram(
            "stoker_request_ttft_seconds",
            "From arrival at the activator to the first body byte from the instance.",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "stoker_request_duration_seconds",
            "From arrival at the activator to the end of the response.",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_length = Gauge(
            "stoker_queue_length",
            "Requests held now, waiting for an instance.",
            ["deployment"],
            registry=registry,
        )
        # Three bands, not a series per priority (-1000..1000 would be 2,001 of them per deployment).
        self.queue_by_priority = Gauge(
            "stoker_queue_length_by_priority",
            "Requests held now, by priority band: high (priority below 0, served first), default (0), "
            "low (above 0).",
            ["deployment", "band"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "stoker_queue_wait_seconds",
            "Time a request was held waiting for an instance (granted, timed out or abandoned).",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ejections = Counter(
            "stoker_instance_ejections_total",
            "Instances taken out of routing for failing requests or probes (each ejection, re-ejections included).",
            ["deployment"],
            registry=registry,
        )
        self.ejected = Gauge(
            "stoker_instances_ejected",
            "Instances out of routing now for failing, until a probe re-admits them.",
            ["deployment"],
            registry=registry,
        )
        self.cold_start_first_byte = Histogram(
            "stoker_cold_start_first_byte_seconds",
            "Cold starts, last phase: from the held request getting its instance to the first byte of the answer (a stream's first SSE event, which may precede the first token).",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
