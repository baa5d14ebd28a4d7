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
    # A start the pool expects to take longer (its tier's measured start, `expected_start_s`:
    # vLLM's first compile on a busy machine took over 180 s; llm-d measured 98-110 s for cold 32B
    # pods) holds its requests START_SLACK times that long, up to this cap.
    hold_deadline_max_s: float = 600.0
    # While a stream is held, a keep-alive (`proxy.KEEPALIVE`) this often; None: none, and the held
    # stream's headers wait for its answer's. 5 s is well inside the shortest idle timeouts of the
    # proxies in front of such streams (30 s: HAProxy's usual `timeout server`, Heroku's router before
    # a first byte; nginx and AWS's load balancers allow 60 s): even a stream held for the whole
    # `hold_deadline_s` (24 keep-alives) stays well under go-openai's 300 lines that are not data.
    keepalive_interval_s: float | None = 5.0
    # A held plain (non-stream) request: None (the default), nothing until its answer, whose status
    # is the answer's; or every this often, after a 200 `application/json` start at the first one, a
    # space, which JSON parsers skip before a value, so a proxy that closes connections idle for
    # its timeout (often 60 s, shorter than a big model's cold start) does not cut it. The price: a
    # failure after that start (the hold deadline, the engine's 4xx or 5xx) can no longer be a
    # status code; it comes as OpenAI's error object in the 200's body (`x-stoker-held: whitespace`
    # tells a client to look). Off by default for that reason.
    plain_keepalive_interval_s: float | None = None
    connect_timeout_s: float = 5.0  # TCP connect to an instance
    # Upstream response headers of a plain (non-stream) request. Both engines send those with the
    # whole answer, after the last token, so this bounds the entire generation: keep it long. It also bounds a stream's.
    first_byte_timeout_s: float = 300.0
    # Upstream response headers of a stream. Both engines send them before the first token: vLLM
    # as soon as the request is parsed, the CPU engine once it is admitted, which is at once since
    # the activator sends an instance no more than its `--max-num-seqs`. So a long prefill does not
    # count, and silence here means a sick instance (stopped, wedged): retried on another one.
    stream_headers_timeout_s: float = 10.0
    chunk_gap_timeout_s: float = 300.0  # silence allowed between two chunks of an upstream body
    retry_after_s: int = 2  # the Retry-After the gateway sends with a 503
    # Outlier ejection (`ejection.py`): this many failures in a row take an instance out of routing
    # for `eject_base_s`, doubling on each ejection in a row up to `eject_max_s`; it comes back
    # after a probe (GET /health) answers 200.
    eject_after: int = 3
    eject_base_s: float = 10.0
    eject_max_s: float = 300.0
    # An instance ejected this many times in a row, with no request answered between, is stopped
    # or wedged rather than slow: it is reported unhealthy and the pool replaces it (with the
    # defaults, after about 30 s out of routing). Otherwise an instance that every probe finds
    # silent would hold its place in the pool, and with it the deployment's held requests, for ever.
    replace_after_ejections: int = 3
    # Active health checks: every READY instance's /health, each `health_interval_s`, within
    # `health_timeout_s`. A failed probe counts as a failure; a 503 (the engine says it is
    # failed) also has the source replace the instance.
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        _check_int("max_queued", self.max_queued, 0, 1_000_000)
        _check_int("retry_after_s", self.retry_after_s, 1, 3600)
        _check_int("eject_after", self.eject_after, 1, 1000)
        _check_int("replace_after_ejections", self.replace_after_ejections, 1, 1000)
        for f in fields(self):
            if f.name.endswith("_s") and f.name != "retry_after_s":
                if (
                    f.name in ("keepalive_interval_s", "plain_keepalive_interval_s")
                    and getattr(self, f.name) is None
                ):
                    continue  # off
                _check_seconds(f.name, getattr(self, f.name))
        _check_order("eject_base_s", self.eject_base_s, "eject_max_s", self.eject_max_s)
        _check_order("hold_deadline_s", self.hold_deadline_s, "hold_deadline_max_s", self.hold_deadline_max_s)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    # Every wait has a deadline: infinity and NaN are refused along with zero and negatives.
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def _check_order(name: str, value: float, bound_name: str, bound: float) -> None:
    if value > bound:
        raise ValueError(f"{name} must be at most {bound_name} ({bound:g}), got {value!r}")
