"""Cascade routes: a name that answers from a small deployment and escalates to a large one.

A route (`assist` → small `tiny`, large `big`) is called like a deployment (`"model": "assist"`).
A plain (non-streaming) request goes to the small deployment first, with logprobs asked for, and
its answer is kept back, not sent, while it is judged (at most `MAX_ANSWER_BYTES`) by the rules of
`stoker.spec.routes`: sure enough stays, unsure, too long for the small one's context or failed
goes to the large one.

The client sees one answer; `x-stoker-cascade` says which way it went, and
`x-stoker-cascade-logprob` the small answer's score when it was judged. Logprobs the client did
not ask for are taken out of the answer again (`"logprobs": null`, as when not asked), except from
an answer past `MAX_ANSWER_BYTES`, which goes out as it comes. A limited key is charged the tokens
of the answer it gets (`limits.UsageTap` reads what reaches the client), not the small side's
refused or escalated one.
The answer's `model` is the deployment that answered (what it returns, untouched): a stream's
chunks are relayed unparsed, so rewriting it there would mean parsing every chunk, and the name
tells the client the same thing as the header.

A stream is decided before its first byte only: it goes to the large deployment at once when its
prompt is clearly too long for the small one's context, or when the small one answers a
context-length 400 or a 5xx (those come before any stream byte); otherwise the small one's stream
goes through as it comes, unjudged. A stream held at zero whose keep-alives already went out
(`activator.proxy.Reply.keepalive`) has started its 200: it stays with the small one.

Where the routes come from is a `RouteSource`: the SQLite table (`stoker.control.routes`; on a
cluster StokerRoutes) in `stoker up` and in the controller, which publishes them in its routing
table; a gateway of its own serves its synced copy of that, and never writes one.

Who may call a route: the caller's key must list the route's name AND both deployments; any
other caller gets the 404 a deployment that does not exist gets. So a route never lets a key reach
a deployment it could not call by name, and a key made for `tiny` alone does not gain `assist`.

Metrics (on the platform's registry; `route` is the route's name):

- `stoker_cascade_requests_total{route,outcome}`: outcome small, escalated_unsure,
  escalated_context, escalated_error. The share escalated:
  `1 - sum(rate(stoker_cascade_requests_total{outcome="small"}[5m])) / sum(rate(stoker_cascade_requests_total[5m]))`.
- `stoker_cascade_latency_seconds{route,side}`: each side's time, from the call to its deployment
  to the end of its answer (side small: every call to it, escalated ones too; side large).
- `stoker_cascade_saved_seconds_total{route}` and `stoker_cascade_lost_seconds_total{route}`:
  latency saved against sending everything to the large deployment. For an answer the small one
  gave in t seconds, L − t where L is the mean of the route's last `LARGE_WINDOW` large answers
  (200s), added to saved when positive and to lost when negative; for an escalated request, the
  seconds spent on the small one before escalating, added to lost. Net saving:
  `saved_total - lost_total`. Until the route has seen the large one answer once, small answers
  add to neither (nothing to compare with).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stoker.errors import UNAVAILABLE, APIError
from stoker.spec.routes import (
    ESCALATED_CONTEXT,
    ESCALATED_ERROR,
    ESCALATED_UNSURE,
    OUTCOMES,
    SMALL,
    CascadeRoute,
    context_exceeded,
    context_of,
    mean_logprob,
    prompt_tokens_at_least,
    saving,
    with_logprobs,
    without_logprobs,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# The activator (aiohttp) and prometheus_client are imported where the serving side is built, not
# here: `stoker routes` (the CLI) takes `stoker.spec.routes`' names, and `stoker --help` stays quick.

log = logging.getLogger("stoker.cascade")

MAX_ANSWER_BYTES = 4 << 20  # a small answer kept back to be judged: the gateway's body bound
MAX_ERROR_BYTES = 64 << 10  # a stream's error answer kept back to be read (as `activator.proxy`)
LARGE_WINDOW = 32  # the large side's recent answers the saving is measured against

Send = Callable[[MutableMapping[str, Any]], Any]


class RouteSource(Protocol):
    """Where `Cascades` reads routes: `stoker.control.routes`'s SQLite table or a gateway's synced
    copy of the controller's."""

    def get(self, name: str) -> CascadeRoute | None: ...

    def all(self) -> list[CascadeRoute]: ...


class RouteTable(RouteSource, Protocol):
    """The routes a process owns and the admin API writes (`stoker.control.routes.CascadeRoutes`;
    on a cluster `stoker.control.kube.routes.ResourceRoutes`, whose writes are API calls)."""

    async def put(self, route: CascadeRoute) -> bool: ...

    async def delete(self, name: str) -> CascadeRoute: ...

    def close(self) -> None: ...


# ---- metrics -----------------------------------------------------------------------------------


class CascadeMetrics:
    """The cascade's series (see the module docstring for their definitions)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Histogram

        from activator.metrics import LATENCY_BUCKETS

        self.requests = Counter(
            "stoker_cascade_requests_total",
            "Requests to cascade routes, by route and outcome (small, escalated_unsure, "
            "escalated_context, escalated_error).",
            ["route", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "stoker_cascade_latency_seconds",
            "Each side's time on a cascade route's request, from the call to its deployment to the end "
            "of its answer (side small: every call to it, escalated ones included).",
            ["route", "side"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.saved = Counter(
            "stoker_cascade_saved_seconds_total",
            "For answers the small deployment gave: the route's recent mean large-side latency minus the "
            "small side's, where positive.",
            ["route"],
            registry=registry,
        )
        self.lost = Counter(
            "stoker_cascade_lost_seconds_total",
            "Seconds spent on the small deployment before escalating, plus, for answers the small one "
            "gave, its latency over the route's recent mean large-side latency. Net saving: saved - lost.",
            ["route"],
            registry=registry,
        )


# ---- serving -----------------------------------------------------------------------------------


class Cascades:
    """The routes as a gateway serves them: the lookup on the request path, each route's two-step
    serving, the metrics. `platform` needs `get(name)` (a deployment with `spec` and `serve`).

    Where the routes come from: the table this process owns (`table`: opens it at first use, e.g.
    `stoker.control.routes.CascadeRoutes` in the platform's `stoker.db`), and the small deployment's context
    from its snapshot (with a `store`, a `SnapshotStore`; without one, no pre-check). A gateway of
    its own passes `routes` (its synced copy; then `table` refuses: a gateway never writes routes)
    and `contexts` (each route's small context, as the controller published it)."""

    def __init__(
        self,
        platform: Any,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        *,
        table: Callable[[], RouteTable] | None = None,
        routes: RouteSource | None = None,
        contexts: Callable[[CascadeRoute], int | None] | None = None,
    ) -> None:
        self._platform = platform
        self._open_table = table
        self._table: RouteTable | None = None
        self._synced = routes
        self._context_of = contexts if contexts is not None else self.small_context
        self.metrics = CascadeMetrics(registry)
        self._clock = clock
        self._large_s: dict[str, deque[float]] = {}  # route -> its last LARGE_WINDOW large answers
        self.counts: dict[str, dict[str, int]] = {}  # route -> outcome -> requests, for the admin API
        self._contexts: dict[str, int] = {}  # snapshot id -> context, read once

    @property
    def table(self) -> RouteTable:
        """The routes this process owns, to read and write (the admin API's)."""
        if self._synced is not None:
            raise RuntimeError("this process serves a synced copy of the routes; the controller owns them")
        if self._open_table is None:
            raise RuntimeError("these cascades were built without a table of their own (`table`)")
        if self._table is None:
            self._table = self._open_table()
        return self._table

    @property
    def routes(self) -> RouteSource:
        """The routes as served: the synced copy, or the table."""
        return self._synced if self._synced is not None else self.table

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None

    def small_context(self, route: CascadeRoute) -> int | None:
        """The route's small deployment's context, from its snapshot's config (cached by snapshot),
        or None: not deployed, no store, the snapshot not here (in object storage only), or no
        config that says. What the controller publishes to gateways as `small_context`."""
        small = self._platform.get(route.small)
        store = getattr(self._platform, "store", None)
        if small is None or store is None:
            return None
        spec = small.spec
        context = self._contexts.get(spec.snapshot_id)
        if context is None:
            context = context_of(store.path_of(spec.snapshot_id), spec.engine)
            if context is not None:
                self._contexts[spec.snapshot_id] = context
        return context

    def conflict(self, name: str) -> APIError | None:
        """The 409 a deploy named like a route gets (`Platform.deploy`'s check), or None."""
        if self.routes.get(name) is None:
            return None
        return APIError(
            409,
            f"{name!r} is a cascade route's name; `stoker routes rm {name}` first.",
            param="name",
            code="name_taken",
        )

    def lookup(self, name: str, may_call: Callable[[str], bool]) -> RouteTarget | None:
        """The route `name` as the request path calls it, or None when there is none or the caller
        may not call both its deployments (the caller's right to the route's own name is the
        gateway's check, as for a deployment)."""
        route = self.routes.get(name)
        if route is None or not (may_call(route.small) and may_call(route.large)):
            return None
        return RouteTarget(self, route)

    def forget(self, name: str) -> None:
        self._large_s.pop(name, None)
        self.counts.pop(name, None)
        for outcome in OUTCOMES:
            _remove(self.metrics.requests, name, outcome)
        for side in ("small", "large"):
            _remove(self.metrics.latency, name, side)
        _remove(self.metrics.saved, name)
        _remove(self.metrics.lost, name)

    async def serve(
        self,
        route: CascadeRoute,
        scope: MutableMapping[str, Any],
        receive: Callable,
        send: Send,
        parsed: dict,
        stream: bool,
        owner: str,
    ) -> None:
        from activator import ActivatorError

        small, large = self._deployments(route)
        receive = _Watched(receive)
        if route.escalate_on_context and self._too_long(route, parsed):
            await self._escalate(
                route, large, ESCALATED_CONTEXT, None, scope, receive, send, parsed, stream, owner
            )
            return
        added = False
        asked = parsed
        if not stream:
            asked, added = with_logprobs(parsed, chat=scope["path"].endswith("/chat/completions"))
        asked = {**asked, "model": route.small}
        held = _Held(send, MAX_ERROR_BYTES if stream else MAX_ANSWER_BYTES, _held_status(stream))
        started = self._clock()
        try:
            await small.serve(scope, receive, held, _encode(asked), asked, stream, owner)
            failed = None
        except ActivatorError as exc:  # raised only before any header: nothing went out
            failed = exc
        small_s = self._clock() - started
        self.metrics.latency.labels(route.name, "small").observe(small_s)
        if failed is not None:
            log.info(
                "route %s: %s failed (%s); escalating to %s", route.name, route.small, failed, route.large
            )
            self._lost(route, small_s)
            await self._escalate(
                route, large, ESCALATED_ERROR, None, scope, receive, send, parsed, stream, owner
            )
            return
        if held.passed:  # gone out as it came: a stream, an answer past the bound
            self._answered_small(route, small_s, held.status)
            return
        if receive.left or not held.done:  # the client left: nobody to answer
            return
        outcome, score, answer = _judge(route, held, added, parsed)
        if outcome == SMALL:
            await held.release(_tag(held.start, SMALL, score), answer)
            self._answered_small(route, small_s, held.status)
            return
        self._lost(route, small_s)
        await self._escalate(route, large, outcome, score, scope, receive, send, parsed, stream, owner)

    async def _escalate(
        self,
        route: CascadeRoute,
        large: Any,
        outcome: str,
        score: float | None,
        scope: MutableMapping[str, Any],
        receive: Callable,
        send: Send,
        parsed: dict,
        stream: bool,
        owner: str,
    ) -> None:
        self._count(route, outcome)
        asked = {**parsed, "model": route.large}
        status = 0

        async def tagged(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _tag(message, outcome, score)
            await send(message)

        started = self._clock()
        await large.serve(scope, receive, tagged, _encode(asked), asked, stream, owner)
        large_s = self._clock() - started
        self.metrics.latency.labels(route.name, "large").observe(large_s)
        if status == 200:  # an error's time says nothing about the large side's answers
            self._large_s.setdefault(route.name, deque(maxlen=LARGE_WINDOW)).append(large_s)

    def _answered_small(self, route: CascadeRoute, small_s: float, status: int) -> None:
        self._count(route, SMALL)
        if status != 200:
            return
        saved = saving(small_s, self._large_s.get(route.name, ()))
        if saved is None:
            return
        if saved >= 0:
            self.metrics.saved.labels(route.name).inc(saved)
        else:
            self.metrics.lost.labels(route.name).inc(-saved)

    def _lost(self, route: CascadeRoute, seconds: float) -> None:
        self.metrics.lost.labels(route.name).inc(max(0.0, seconds))

    def _count(self, route: CascadeRoute, outcome: str) -> None:
        self.metrics.requests.labels(route.name, outcome).inc()
        self.metrics.saved.labels(route.name)  # both at 0 from the route's first request on
        self.metrics.lost.labels(route.name)
        counts = self.counts.setdefault(route.name, dict.fromkeys(OUTCOMES, 0))
        counts[outcome] += 1

    def _deployments(self, route: CascadeRoute) -> tuple[Any, Any]:
        small, large = self._platform.get(route.small), self._platform.get(route.large)
        for name, deployment in ((route.small, small), (route.large, large)):
            if deployment is None:
                raise APIError(
                    503,
                    f"Route {route.name!r} answers from deployment {name!r}, which is not deployed now.",
                    type=UNAVAILABLE,
                    code="route_deployment_missing",
                )
        return small, large

    def _too_long(self, route: CascadeRoute, parsed: dict) -> bool:
        """Whether the request clearly does not fit the small deployment's context (the estimate
        undercounts; see `stoker.spec.routes`). An unknown context: no pre-check."""
        context = self._context_of(route)
        return context is not None and prompt_tokens_at_least(parsed) > context


@dataclass(frozen=True)
class RouteTarget:
    """A route as the gateway's request path sees it: something with `serve`, as a deployment."""

    cascades: Cascades
    route: CascadeRoute

    async def serve(self, scope, receive, send, body: bytes, parsed: dict, stream: bool, owner: str) -> None:
        await self.cascades.serve(self.route, scope, receive, send, parsed, stream, owner)


def _judge(route: CascadeRoute, held: _Held, added: bool, parsed: dict) -> tuple[str, float | None, bytes]:
    """What a kept-back small answer leads to: (outcome, its score, the body to send if it is the
    answer)."""
    body = b"".join(held.parts)
    if held.status >= 500:
        return ESCALATED_ERROR, None, body
    if route.escalate_on_context and context_exceeded(held.status, body):
        return ESCALATED_CONTEXT, None, body
    if held.status != 200:
        return SMALL, None, body
    try:
        answer = json.loads(body)
    except ValueError:
        return SMALL, None, body
    score = mean_logprob(answer, skip_prompt=parsed.get("echo") is True)
    if score is not None and score < route.min_mean_logprob:
        return ESCALATED_UNSURE, score, body
    if added and isinstance(answer, dict):
        body = json.dumps(without_logprobs(answer)).encode()
    return SMALL, score, body


def _held_status(stream: bool) -> Callable[[int], bool]:
    """Which answers of the small side are kept back: a plain request's all (each is judged); a
    stream's only a 400 (context?) or a 5xx, which come before any stream byte."""
    if stream:
        return lambda status: status == 400 or status >= 500
    return lambda status: True


class _Held:
    """An ASGI `send` that keeps the small side's answer back: its start and its body, up to `limit`
    bytes, when `hold(status)` says so. Any other answer, or one past the limit, goes on to `send`
    as it comes (tagged as the small side's): too late to escalate."""

    __slots__ = ("_hold", "_limit", "_send", "done", "parts", "passed", "size", "start", "status")

    def __init__(self, send: Send, limit: int, hold: Callable[[int], bool]) -> None:
        self._send = send
        self._limit = limit
        self._hold = hold
        self.start: MutableMapping[str, Any] | None = None
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.passed = False  # some of it went out
        self.done = False  # all of it is here

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if self.passed:
            await self._send(message)
            return
        if message["type"] == "http.response.start":
            self.start, self.status = message, message["status"]
            if not self._hold(self.status):
                self.passed = True
                await self._send(_tag(message, SMALL, None))
            return
        chunk = message.get("body", b"")
        self.parts.append(chunk)
        self.size += len(chunk)
        if not message.get("more_body", False):
            self.done = True
        elif self.size > self._limit:
            self.passed = True
            await self._send(_tag(self.start, SMALL, None))
            await self._send({"type": "http.response.body", "body": b"".join(self.parts), "more_body": True})
            self.parts = []

    async def release(self, start: MutableMapping[str, Any], body: bytes) -> None:
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


class _Watched:
    """The client's `receive`, noting whether it left (both sides' activators watch it)."""

    __slots__ = ("_receive", "left")

    def __init__(self, receive: Callable) -> None:
        self._receive = receive
        self.left = False

    async def __call__(self) -> MutableMapping[str, Any]:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.left = True
        return message


def _tag(start: MutableMapping[str, Any], outcome: str, score: float | None) -> dict[str, Any]:
    """The response start with the cascade's headers; no content-length (the body may change)."""
    headers = [(n, v) for n, v in start.get("headers", []) if n.lower() != b"content-length"]
    headers.append((b"x-stoker-cascade", outcome.replace("_", "-").encode()))
    if score is not None:
        headers.append((b"x-stoker-cascade-logprob", f"{score:.4f}".encode()))
    return {**start, "headers": headers}


def _encode(parsed: dict) -> bytes:
    return json.dumps(parsed, separators=(",", ":")).encode()


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never observed
        pass
