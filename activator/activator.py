"""The activator of one deployment: hold a request until an instance has room, then proxy it.

    serve ─▶ slot free? ──yes──────────────────────────▶ forward ─▶ done
               │ no                                        │ failed before the first byte
               ▼                                           ▼
             hold (bounded, deadline, poke the pool,     report_failure, then once more on
             SSE keep-alive for streams)                 another instance (held again if none)

Held requests wait on a future that `Slots` resolves, in arrival order, when `capacity_changed()`
is called or a request finishes. A task watches `receive()` the whole time: a client that leaves
cancels the work at once, which takes it out of the queue or closes the upstream connection.
When the source says no instance can start (`set_unavailable`, e.g. a corrupt snapshot), held
requests are answered 503 with its reason at once, and new ones are not held.

The source hears of every request twice, `request_arrived` and `request_finished` (with the seconds
it held instances, and the instance it was a cold start on): the scaler's tracker counts arrivals,
idle gaps and latency from these. A cold start is a request served by an instance that was not in
the routing set when the request arrived (it started or woke up since): the simulator's definition
(`warm_pool.simulate`), so live and simulated counts compare. `x-stoker-cold-start` says the same,
except on a held stream, whose headers go out before its instance is known: there it says true only
when nothing at all was READY at arrival (then whatever serves it is certainly a cold start).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

from activator import proxy
from activator.config import ActivatorConfig
from activator.errors import (
    ActivatorError,
    DeadlineExceeded,
    NoCapacity,
    QueueFull,
    Unavailable,
    UpstreamError,
)
from activator.metrics import ActivatorMetrics
from activator.slots import Key, Slots, key
from activator.source import Endpoint, InstanceSource, Load

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
CLIENT_LEFT = 499  # nginx's "client closed request", for the metrics only


class _Exchange:
    """One request's state as it moves through the activator."""

    __slots__ = (
        "arrival",
        "body",
        "code",
        "cold",
        "cold_on",
        "content_type",
        "granted",
        "held_s",
        "path",
        "reply",
        "routing",
        "stream",
        "upstream_status",
    )

    def __init__(
        self, scope: MutableMapping[str, Any], send: proxy.Send, body: bytes, stream: bool, now: float
    ):
        self.arrival = now
        query = scope.get("query_string", b"")
        self.path: str = scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        self.content_type = next((v for n, v in scope["headers"] if n == b"content-type"), None)
        self.body = body
        self.stream = stream
        self.reply = proxy.Reply(send)
        self.cold = False  # served by an instance that was not routable at arrival (see the module doc)
        self.cold_on: str | None = None  # that instance's id
        self.routing: frozenset[Key] | None = None  # the routing set when it was held at arrival
        self.granted: float | None = None  # when a held request got its slot
        self.held_s: float | None = None  # seconds it held instance slots; None: it never got one
        self.upstream_status = 0  # the status of the answer whose first byte went to the client
        self.code = 0


class Activator:
    def __init__(
        self,
        deployment: str,
        source: InstanceSource,
        config: ActivatorConfig,
        session: aiohttp.ClientSession,
        metrics: ActivatorMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deployment = deployment
        self._source = source
        self._config = config
        self._session = session
        self._clock = clock
        self._slots = Slots(source.endpoints)
        self._last_arrival: float | None = None
        self._metrics = metrics
        self._codes: dict[int, Any] = {}
        self._ttft = metrics.ttft.labels(deployment)
        self._duration = metrics.duration.labels(deployment)
        self._queue_length = metrics.queue_length.labels(deployment)
        self._queue_wait = metrics.queue_wait.labels(deployment)
        self._cold_first_byte = metrics.cold_start_first_byte.labels(deployment)
        self._unavailable: str | None = None  # why no instance can start, while the source says so

    # -- what the pool and the scaler see ------------------------------------------------------

    def capacity_changed(self) -> None:
        """The routing set changed (an instance became READY, or left): wake held requests."""
        self._slots.dispatch()

    def set_unavailable(self, reason: str | None) -> None:
        """The source cannot start an instance (`reason`, one line), or can again (None). Meanwhile
        held requests are answered `Unavailable(reason)` at once, and so is every request that finds
        no free slot, instead of waiting out the hold deadline for an instance that will not come."""
        self._unavailable = reason
        if reason is not None:
            self._slots.fail_held(lambda: Unavailable(reason, self._config.retry_after_s))

    def load(self) -> Load:
        return Load(
            in_flight=self._slots.in_flight,
            queued=self._slots.held,
            last_arrival=self._last_arrival,
            outstanding=dict(self._slots.outstanding),
        )

    def outstanding(self, endpoint_id: str) -> int:
        return self._slots.outstanding.get(endpoint_id, 0)

    # -- the request path ----------------------------------------------------------------------

    async def serve(
        self,
        scope: MutableMapping[str, Any],
        receive: Receive,
        send: proxy.Send,
        body: bytes,
        stream: bool,
    ) -> None:
        """Answer one request whose body the gateway has read. Raises an `ActivatorError` only
        while no header went to the client; after that every outcome is written to the stream."""
        now = self._clock()
        self._last_arrival = now
        ex = _Exchange(scope, send, body, stream, now)
        self._source.request_arrived()  # from here on, request_finished follows in every case
        work = asyncio.ensure_future(self._run(ex))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()  # no-op once done
            watcher.cancel()
            await asyncio.wait((work, watcher))  # both settled; their outcome is read below
        try:
            if work.cancelled():  # the client left first
                ex.code = CLIENT_LEFT
                if not watcher.cancelled():
                    watcher.exception()  # a failing receive() also ends the exchange: retrieved
            else:
                work.result()
        except NoCapacity:
            ex.code = 503
            raise
        except UpstreamError:
            ex.code = 502
            raise
        except Exception:
            ex.code = ex.code or 500
            raise
        finally:
            self._count(ex)
            self._source.request_finished(ex.held_s, ex.cold_on)

    async def _run(self, ex: _Exchange) -> None:
        try:
            endpoint = self._slots.try_acquire()
            if endpoint is None:
                ex.routing = frozenset(key(e) for e in self._source.endpoints())
                ex.cold = not ex.routing  # nothing READY: whatever serves it is a cold start
                # The bound is on requests held at arrival; a retry (at most one per request in
                # flight, so bounded by the instances' concurrency) is held past it.
                if self._slots.held >= self._config.max_queued:
                    self._source.poke()  # demand exists even if this one is refused
                    raise QueueFull(self._config.retry_after_s, self._config.max_queued)
                endpoint = await self._hold(ex, exclude=(), front=False)
                ex.cold = key(endpoint) not in ex.routing
                ex.cold_on = endpoint.id if ex.cold else None
            failed: tuple[Key, ...] = ()
            while True:
                last = bool(failed)
                acquired_at = self._clock()
                try:
                    ex.code = await proxy.forward(
                        self._session,
                        endpoint,
                        ex.path,
                        ex.body,
                        ex.content_type,
                        ex.reply,
                        self._config,
                        last=last,
                        cold=ex.cold,
                        on_first_byte=lambda status: self._first_byte(ex, status),
                    )
                    if ex.upstream_status in proxy.RETRYABLE:  # failed twice: passed through as is
                        self._source.report_failure(endpoint.id)
                    return
                except proxy.Failed as exc:
                    self._source.report_failure(endpoint.id)
                    if last:
                        raise UpstreamError(str(exc)) from None
                finally:
                    self._slots.release(endpoint.id)
                    ex.held_s = (ex.held_s or 0.0) + max(0.0, self._clock() - acquired_at)
                failed = (key(endpoint),)
                endpoint = self._slots.try_acquire(failed) or await self._hold(ex, exclude=failed, front=True)
        except ActivatorError as exc:
            if not ex.reply.started:
                raise
            # A held stream already answered 200: the error can only travel as an SSE event.
            ex.code = 503 if isinstance(exc, NoCapacity) else 502
            kind = "service_unavailable_error" if isinstance(exc, NoCapacity) else "server_error"
            await ex.reply.end(proxy.error_event(str(exc), kind, exc.code))

    async def _hold(self, ex: _Exchange, exclude: tuple[Key, ...], front: bool) -> Endpoint:
        """Wait for a slot in FIFO order, within `hold_deadline_s`; keep a held stream alive."""
        config = self._config
        if self._unavailable is not None:
            raise Unavailable(self._unavailable, config.retry_after_s)
        waiter = self._slots.hold(exclude, front)
        self._source.poke()  # at once: the pool must not wait for its next tick
        self._queue_length.inc()
        held_at = self._clock()
        deadline = held_at + config.hold_deadline_s
        next_keepalive = held_at + config.keepalive_interval_s if ex.stream else math.inf
        taken = False
        try:
            while True:
                if waiter.future.done():
                    taken, ex.granted = True, self._clock()
                    return waiter.future.result()
                now = self._clock()
                if now >= deadline:
                    raise DeadlineExceeded(config.retry_after_s, now - held_at)
                if now >= next_keepalive:
                    await ex.reply.keepalive(ex.cold)
                    next_keepalive += config.keepalive_interval_s
                    continue
                # Not wait_for: a timeout must not cancel the future the dispatcher resolves.
                await asyncio.wait((waiter.future,), timeout=min(deadline, next_keepalive) - now)
        finally:
            if not taken:
                self._slots.abandon(waiter)
            self._queue_length.dec()
            self._queue_wait.observe(self._clock() - held_at)

    def _first_byte(self, ex: _Exchange, status: int) -> None:
        ex.upstream_status = status
        if status >= 400:  # an error is not a first token
            return
        now = self._clock()
        self._ttft.observe(now - ex.arrival)
        if ex.cold and ex.granted is not None:
            self._cold_first_byte.observe(now - ex.granted)

    def _count(self, ex: _Exchange) -> None:
        code = ex.code
        counter = self._codes.get(code)
        if counter is None:
            counter = self._codes[code] = self._metrics.requests.labels(self.deployment, str(code))
        counter.inc()
        if ex.reply.started:  # errors raised to the gateway are answered, and timed, there
            self._duration.observe(self._clock() - ex.arrival)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
