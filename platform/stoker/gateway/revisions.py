"""Revisions on the request path: which revision answers a request, what each one's answers were
like, and when a canary has failed.

    request ──▶ pick_revision: the admin's pin, else choose(bucket of `user` / x-stoker-session)
            ──▶ answer_on(revision N's activator)
                 answer ──▶ + `x-stoker-revision: N` ──▶ RevisionStats (metrics, canary window)

A split is whole percents per revision, summing to 100. A request with a `user` field or an
`x-stoker-session` header is hashed into one of 10,000 buckets, so one user sees one revision for
as long as the split stands (and, when a canary grows, only users moving into it change sides); a
request with neither is placed at random.

A canary (a revision with part of the traffic, newer than the rest) that asks for it
(`auto_rollback`) is judged over its last `rollback_window_s`: with at least
`rollback_min_requests` answers, it fails when its share of 5xx, or of first bytes later than
`rollback_ttft_s`, exceeds `rollback_error_rate` (`canary_verdict`, a pure function).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from activator import Activator, ActivatorError
from activator.adapters import AdapterRef
from stoker.errors import invalid
from stoker.spec.deployment import DeploymentSpec

BUCKETS = 10_000
SESSION_HEADER = b"x-stoker-session"
REVISION_HEADER = b"x-stoker-revision"
WINDOW_MAX = 10_000  # answers kept per revision for the canary check
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


def bucket_of(parsed: Mapping[str, Any], headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's bucket (0..BUCKETS-1) from its session header, else its `user` field; None
    when it has neither."""
    ident = next((v for n, v in headers if n == SESSION_HEADER), None)
    if ident is None:
        user = parsed.get("user")
        if not isinstance(user, str) or not user:
            return None
        ident = user.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(ident[:1024], digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def choose(traffic: Mapping[int, int], bucket: int | None, rand: Callable[[], float] = random.random) -> int:
    """The revision a request in `bucket` goes to: the split laid out over the buckets in
    revision order, so growing the newest revision's share moves only the buckets it takes."""
    if bucket is None:
        bucket = int(rand() * BUCKETS)
    edge = 0
    revisions = sorted(traffic)
    for revision in revisions:
        edge += traffic[revision] * BUCKETS // 100
        if bucket < edge:
            return revision
    return revisions[-1]


@dataclass(frozen=True)
class Answer:
    at: float
    error: bool  # 5xx (including the platform's own 502/503s)
    ttft_s: float | None  # arrival to the answer's first body byte; None: no body went out


def canary_verdict(answers: list[Answer], spec: DeploymentSpec, now: float) -> str | None:
    """Why the canary revision `spec` failed over its window, or None while it has not (or has too
    few answers to tell)."""
    recent = [a for a in answers if a.at > now - spec.rollback_window_s]
    if len(recent) < spec.rollback_min_requests:
        return None
    errors = sum(a.error for a in recent) / len(recent)
    if errors > spec.rollback_error_rate:
        return (
            f"5xx on {errors:.0%} of {len(recent)} answers in {spec.rollback_window_s:g}s "
            f"(over {spec.rollback_error_rate:.0%})"
        )
    if spec.rollback_ttft_s > 0:
        slow = sum(a.error or a.ttft_s is None or a.ttft_s > spec.rollback_ttft_s for a in recent) / len(
            recent
        )
        if slow > spec.rollback_error_rate:
            return (
                f"first byte later than {spec.rollback_ttft_s:g}s on {slow:.0%} of {len(recent)} answers "
                f"in {spec.rollback_window_s:g}s (over {spec.rollback_error_rate:.0%})"
            )
    return None


class RevisionMetrics:
    """What each revision answered: requests by status, time to first byte, its traffic share,
    and automatic rollbacks."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "stoker_revision_requests_total",
            "Requests answered, by deployment, revision and HTTP status.",
            ["deployment", "revision", "code"],
            registry=registry,
        )
        self.ttft = Histogram(
            "stoker_revision_first_byte_seconds",
            "Arrival to the answer's first body byte (the first token of a stream), by revision.",
            ["deployment", "revision"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.traffic = Gauge(
            "stoker_revision_traffic_percent",
            "Each revision's share of its deployment's traffic.",
            ["deployment", "revision"],
            registry=registry,
        )
        self.rollbacks = Counter(
            "stoker_revision_rollbacks_total",
            "Canaries rolled back by themselves (auto_rollback), by deployment.",
            ["deployment"],
            registry=registry,
        )

    def set_traffic(self, deployment: str, traffic: Mapping[int, int], known: list[int]) -> None:
        for revision in known:
            self.traffic.labels(deployment, str(revision)).set(traffic.get(revision, 0))


class RevisionStats:
    """One deployment's recent answers per revision, for the canary check, and their metrics."""

    def __init__(
        self, deployment: str, metrics: RevisionMetrics, clock: Callable[[], float] = time.monotonic
    ):
        self.deployment = deployment
        self._metrics = metrics
        self._clock = clock
        self._answers: dict[int, deque[Answer]] = {}

    def record(self, revision: int, status: int, ttft_s: float | None, *, count: bool = True) -> None:
        """One answer; `count=False` for one a gateway reports, which counted it in its own metrics."""
        self._answers.setdefault(revision, deque(maxlen=WINDOW_MAX)).append(
            Answer(self._clock(), status >= 500, ttft_s)
        )
        if not count:
            return
        self._metrics.requests.labels(self.deployment, str(revision), str(status)).inc()
        if ttft_s is not None:
            self._metrics.ttft.labels(self.deployment, str(revision)).observe(ttft_s)

    def answers(self, revision: int) -> list[Answer]:
        return list(self._answers.get(revision, ()))

    def forget(self, revision: int) -> None:
        self._answers.pop(revision, None)


class Recorder:
    """The `send` a revision answers through: it adds `x-stoker-revision` to the headers and notes
    the status and when the first body byte went out."""

    def __init__(self, send: Callable, revision: int, clock: Callable[[], float], started: float) -> None:
        self._send = send
        self._header = str(revision).encode()
        self._clock = clock
        self._started = started
        self.status = 0
        self.ttft_s: float | None = None

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message = {**message, "headers": [*message.get("headers", ()), (REVISION_HEADER, self._header)]}
        elif message["type"] == "http.response.body" and self.ttft_s is None:
            body = message.get("body", b"")
            if body and not body.startswith(b":"):  # an SSE comment is a held stream's keep-alive
                self.ttft_s = self._clock() - self._started
        await self._send(message)


PINNED = "stoker.pinned_revision"  # the scope's key for a revision the admin asked for
PRIORITY = "stoker.priority"  # the scope's key for the request's priority (`stoker.spec.priority`)


def pin_revision(scope) -> None:
    """Read a request's `x-stoker-revision: N` into the scope, for `pick_revision` to route by
    (the gateway calls this for the admin's requests only: `stoker eval --revision`). A value that
    is no revision number is a 400 naming the header."""
    for name, value in scope.get("headers", ()):
        if name == b"x-stoker-revision":
            if not (value.isdigit() and len(value) <= 10 and 1 <= int(value) <= 1_000_000_000):
                shown = value.decode("latin-1")
                raise invalid(
                    f"'x-stoker-revision' must be a revision number (1, 2, ...), got {shown!r}.",
                    "x-stoker-revision",
                )
            scope[PINNED] = int(value)


async def answer_on(
    activator: Activator,
    revision: int,
    stats: RevisionStats,
    clock: Callable[[], float],
    scope,
    receive,
    send,
    body: bytes,
    parsed: dict,
    stream: bool,
    owner: str,
    adapter: AdapterRef | None = None,
) -> tuple[int, float | None]:
    """One request on one revision's activator: `x-stoker-revision` on the answer, its status and
    first-byte time recorded (and returned); an `ActivatorError` (no header sent yet) is counted as
    the status the gateway will answer with, and raised for it. `adapter`: the LoRA adapter it is
    for, on its base's activator (`stoker.control.adapters`). Its priority is the one the gateway
    settled (`PRIORITY` in the scope; 0 where none did)."""
    scope["stoker.revision"] = revision  # for the gateway's error answers
    recorder = Recorder(send, revision, clock, clock())
    priority = scope.get(PRIORITY, 0)
    try:
        await activator.serve(
            scope, receive, recorder, body, stream, owner, parsed=parsed, adapter=adapter, priority=priority
        )
    except ActivatorError as exc:
        stats.record(revision, exc.status, None)
        raise
    status = recorder.status or 499  # the client left before any answer
    stats.record(revision, status, recorder.ttft_s)
    return status, recorder.ttft_s


def pick_revision(
    name: str, traffic: Mapping[int, int], units: Collection[int], scope, parsed: Mapping[str, Any]
) -> int:
    """The revision that answers one request: the one the admin pinned (`pin_revision`; a 400 if it
    has no instances here), else the split's pick for the request's bucket. One step for both planes:
    `stoker up`'s deployments and a `stoker gateway`'s."""
    if (pinned := scope.get(PINNED)) is not None:
        if pinned not in units:
            have = ", ".join(str(r) for r in sorted(units))
            raise invalid(
                f"Revision {pinned} of {name!r} has no instances to answer with; these do: {have}.",
                "x-stoker-revision",
            )
        return pinned
    return choose(traffic, bucket_of(parsed, scope.get("headers", [])))
