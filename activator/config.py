"""The activator's settings: one frozen, validated value per deployment, defaults in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ActivatorConfig:
    """How long and how many requests to hold, and the deadlines of the streaming proxy.

    There is deliberately no total timeout on a request: a long generation is normal (2,000 tokens
    at 20 tokens/s is 100 s), so only silence is bounded (`chunk_gap_timeout_s`).
    """

    max_queued: int = 100  # requests held at once; one more is refused at once (QueueFull)
    # Must cover a cold start: the CPU engine is up in 6-9 s, vLLM in 30-90 s (imports, CUDA
    # context, weight load, graph capture); 120 s leaves room for the slow end plus a retry.
    hold_deadline_s: float = 120.0
    keepalive_interval_s: float = 5.0  # SSE comment cadence while a stream is held
    connect_timeout_s: float = 5.0  # TCP connect to an instance
    first_byte_timeout_s: float = 300.0  # upstream response headers (prefill of a long prompt, a queue)
    chunk_gap_timeout_s: float = 300.0  # silence allowed between two chunks of an upstream body
    retry_after_s: int = 2  # the Retry-After the gateway sends with a 503

    def __post_init__(self) -> None:
        _check_int("max_queued", self.max_queued, 0, 1_000_000)
        _check_int("retry_after_s", self.retry_after_s, 1, 3600)
        for f in fields(self):
            if f.name.endswith("_s") and f.name != "retry_after_s":
                _check_seconds(f.name, getattr(self, f.name))


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    # Every wait has a deadline: infinity and NaN are refused along with zero and negatives.
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
