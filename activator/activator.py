"""The activator of one deployment: hold a request until an instance has room, then proxy it.

    serve ─▶ slot free? ──yes──────────────────────────▶ forward ─▶ done
               │ no                                        │ failed before the first byte
               ▼                                           ▼
             hold (bounded, deadline, poke the pool,     report_failure, then on another
             SSE keep-alive for streams)                 instance (held again if none), up to
                                                         ATTEMPTS instances in all

Held requests wait on a future that `Slots` resolves, lowest priority first, and within a class in
arrival order for each owner (API key) and in turns between owners, when `capacity_changed()` is
called or a request finishes; a full queue refuses a request of a class served after the newcomer's,
or of its class the newest of the owner holding the most, before it refuses the newcomer. The body
goes upstream with the priority its engine takes (`set_engine_priority`, `priority.forwarded`).
A task watches `receive()` the whole time: a client that leaves cancels the work at once, which
takes it out of the queue or closes the upstream connection; it counts as 499 only when it left
before the whole answer went out (`proxy.Reply.delivered`). When the source says no instance can
start (`set_unavailable`, e.g. a corrupt snapshot), held requests are answered 503 with its reason
at once, and new ones are not held.

The source hears of every request twice, `request_arrived` and `request_finished` (with the seconds
it held instances, and the instance it was a cold start on): the scaler's tracker counts arrivals,
idle gaps and latency from these. A cold start is a request served by an instance that was not in
the routing set when the request arrived (it started or woke up since): the simulator's definition
(`warm_pool.simulate`), so live and simulated counts compare. `x-stoker-cold-start` says the same,
except on a held stream, whose headers go out before its instance is known: there it says true only
when nothing at all was READY at arrival (then whatever serves it is certainly a cold start).

Sick instances leave routing (`routing.HealthRouting`, over `ejection.py`'s rules): every
request's outcome on an instance, and every probe of its /health by `watch_health` (each
`health_interval_s`), feeds that instance's `Health`;
`eject_after` failures in a row eject it, and only routable instances are offered to `Slots`. An
ejection also ends the waits for headers of the requests already sent to that instance, which are
then retried elsewhere, and bounds the silence of its answers already under way to
`stream_headers_timeout_s` (`proxy.Silence`): a stream cut that way ends with an SSE error event.
A probe answering 503 (the engine says it is failed) is reported to the source
(`report_unhealthy`), which replaces the instance; so is one ejected `replace_after_ejections` times
in a row (stopped or wedged: were it kept, a deployment whose every instance is ejected would hold
its requests until their deadline).

Which instance: the one with the fewest outstanding requests, or in prefix mode (`set_balance`,
`affinity.Balance`) the one the request's prompt prefix hashes to, unless that one is above the
load bound (`balancer.pick_by_prefix`). Only prefix mode reads the body (its JSON, unless the
caller passes it parsed), for the immediate pick, a held request's and a retry's alike.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import aiohttp

from activator import affinity, proxy
from activator import priority as priority_field
from activator.adapters import AdapterRef, Adapters, Prefetcher
from activator.affinity import Balance
from activator.config import ActivatorConfig
from activator.errors import (
    ActivatorError,
    DeadlineExceeded,
    QueueFull,
    Unavailable,
    UpstreamError,
)
from activator.metrics import BANDS, ActivatorMetrics, band
from activator.routing import HealthRouting
from activator.slots import Key, Slots, key
from activator.source import Endpoint, InstanceSource, Load

log = logging.getLogger("activator")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
CLIENT_LEFT = 499  # nginx's "client closed request", for the metrics only
START_SLACK = 1.5  # a held request waits this many times the start it waits on is expected to take
# Instances a request is tried on, each failing before its first byte (refused, reset, ejected
# while it waited for headers) excluded from the next: two instances failing at once (one killed,
# one stopped) ended the request 502 when it was tried on two only; a third (held for, if need be)
# answers it, or its hold ends in a clean 503.
ATTEMPTS = 3


class _Exchange:
    """One request's state as it moves through the activator."""

    __slots__ = (
        "adapter",
        "arrival",
        "body",
        "code",
        "cold",
        "cold_on",
        "content_type",
        "granted",
        "held_s",
        "owner",
        "path",
        "prefix",
        "priority",
        "reply",
        "routing",
        "stream",
        "upstream_status",
        "whitespace",
    )

    def __init__(
        self,
        scope: MutableMapping[str, Any],
        send: proxy.Send,
        body: bytes,
        stream: bool,
        now: float,
        owner: str,
        prefix: int | None,
        adapter: AdapterRef | None = None,
        priority: int = 0,
    ):
        self.adapter = adapter  # the LoRA adapter it asks for, loaded on its instance first (`adapters`)
        self.arrival = now
        self.prefix = prefix  # its prompt prefix's key in prefix mode (`affinity.request_key`), else None
        self.owner = owner  # whose request (the API key): the hold queue is shared fairly by owner
        self.priority = priority  # its class in the hold queue: lower is served first
        query = scope.get("query_string", b"")
        self.path: str = scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        self.content_type = next((v for n, v in scope["headers"] if n == b"content-type"), None)
        self.body = body
        self.stream = stream
        self.whitespace = not stream and not scope.get(proxy.IN_PROCESS)  # may a hold keep it alive so
        self.reply = proxy.Reply(send)
        self.cold = False  # served by an instance that was not routable at arrival (see the module doc)
        self.cold_on: str | None = None  # that instance's id
        self.routing: frozenset[Key] | None = None  # the READY set when it was held at arrival
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
        self._balance = Balance()
        self._engine_priority = False  # whether its instances take a body's `priority`
        # Which instances may take requests: the source's, less those ejected for failing.
        self._routing = HealthRouting(
            deployment, source, config, session, metrics, clock, on_back=lambda: self._slots.dispatch()
        )
        self._routable = self._routing.routable
        self._slots = Slots(self._routable, self._balance.bound)
        self._last_arrival: float | None = None
        self._metrics = metrics
        self._codes: dict[int, Any] = {}
        self._ttft = metrics.ttft.labels(deployment)
        self._duration = metrics.duration.labels(deployment)
        self._queue_length = metrics.queue_length.labels(deployment)
        self._queue_bands = {b: metrics.queue_by_priority.labels(deployment, b) for b in BANDS}
        self._queue_wait = metrics.queue_wait.labels(deployment)
        self._cold_first_byte = metrics.cold_start_first_byte.labels(deployment)
        self._unavailable: str | None = None  # why no instance can start, while the source says so
        # The adapters loaded on each instance, for the adapter deployments on this base (`adapters`);
        # `on_adapter_load(name, seconds)` hears of each load.
        self.on_adapter_load: Callable[[str, float], None] = lambda name, seconds: None
        self.adapters = Adapters(lambda: self._session, lambda name, s: self.on_adapter_load(name, s))
        # Adapters loaded ahead of their requests where those would go (`Decision.adapters`).
        self.prefetcher = Prefetcher(
            self.adapters, self._routable, lambda: self._slots.outstanding, lambda: self._slots.bound
        )

    # -- what the pool and the scaler see ------------------------------------------------------

    def capacity_changed(self) -> None:
        """The routing set changed (an instance became READY, or left): wake held requests."""
        self._slots.dispatch()
        if self.adapters.tracked():  # what instances that left held is forgotten (bounded by the live set)
            self.adapters.gone({e.id for e in self._source.endpoints()})

    def set_unavailable(self, reason: str | None) -> None:
        """The source cannot start an instance (`reason`, one line), or can again (None). Meanwhile
        held requests are answered `Unavailable(reason)` at once, and so is every request that finds
        no free slot, instead of waiting out the hold deadline for an instance that will not come."""
        self._unavailable = reason
        if reason is not None:
            self._slots.fail_held(lambda: Unavailable(reason, self._config.retry_after_s))

    def set_balance(self, balance: Balance) -> None:
        """How to pick an instance from now on (least outstanding, or by prompt prefix within a load
        bound). Requests already held keep the key they came with."""
        self._balance = balance
        self._slots.bound = balance.bound

    def set_engine_priority(self, takes: bool) -> None:
        """Whether its engines take a body's `priority` (the CPU engine; vLLM under the priority
        policy): then each body says its request's, else none goes upstream (`priority`)."""
        self._engine_priority = takes

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
        owner: str = "",
        parsed: Mapping[str, Any] | None = None,
        adapter: AdapterRef | None = None,
        priority: int = 0,
    ) -> None:
        """Answer one request whose body the gateway has read, on behalf of `owner` (its API key's
        id; held requests of different owners take turns) at `priority` (its class, checked by the
        gateway: lower is served first). `parsed`: the body's JSON, if the caller
        has it (prefix mode reads the prompt from it instead of parsing `body` again). `adapter`:
        the LoRA adapter it is for (an adapter deployment's request on its base): the instance is
        picked by the adapter's affinity key and has it loaded before the request goes. Raises an
        `ActivatorError` only while no header went to the client; after that every outcome is
        written to the stream."""
        now = self._clock()
        self._last_arrival = now
        balance = self._balance
        if adapter is not None:
            prefix = adapter.key
        else:
            prefix = affinity.request_key(body, balance, parsed) if balance.by_prefix else None
        body = priority_field.forwarded(body, parsed, priority, self._engine_priority)
        ex = _Exchange(scope, send, body, stream, now, owner, prefix, adapter, priority)
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
            if work.cancelled():  # the client left first ...
                # ... before the end of the answer, or after it (the openai client closes at
                # `data: [DONE]`, and may be heard before the relay has seen the body's end).
                ex.code = (ex.code or ex.reply.status) if ex.reply.delivered else CLIENT_LEFT
                if not watcher.cancelled():
                    watcher.exception()  # a failing receive() also ends the exchange: retrieved
            else:
                work.result()
        except ActivatorError as exc:
            ex.code = exc.status
            raise
        except Exception:
            ex.code = ex.code or 500
            raise
        finally:
            self._count(ex)
            if (
                ex.granted is not None
            ):  # how long it was held, for the request's trace (`stoker.gateway.otel`)
                scope["stoker.held_s"] = ex.granted - ex.arrival
            self._source.request_finished(ex.held_s, ex.cold_on)

    async def _run(self, ex: _Exchange) -> None:
        try:
            endpoint = self._slots.try_acquire(prefix=ex.prefix)
            if endpoint is None:
                # READY at arrival, ejected or not: one re-admitted after a probe was there all
                # along, so a request it serves is held, not a cold start.
                ex.routing = frozenset(key(e) for e in self._source.endpoints())
                ex.cold = not ex.routing  # nothing READY: whatever serves it is a cold start
                # The bound is on requests held at arrival; a retry (at most ATTEMPTS - 1 per
                # request in flight, so bounded by the instances' concurrency) is held past it.
                if self._slots.held >= self._config.max_queued and not self._slots.displace(
                    ex.owner, self._queue_full, ex.priority
                ):
                    self._source.poke()  # demand exists even if this one is refused
                    raise self._queue_full()
                endpoint = await self._hold(ex, exclude=(), front=False)
                ex.cold = key(endpoint) not in ex.routing
                ex.cold_on = endpoint.id if ex.cold else None
            failed: tuple[Key, ...] = ()
            reloaded = again = False  # an adapter the engine had evicted is loaded again, once
            while True:
                acquired_at = self._clock()
                k = key(endpoint)
                # The last try, whose retryable status (503...) is passed through as the answer:
                # the ATTEMPTS-th, or a retry with no other instance left to try.
                tried = {*failed, k}
                last = len(failed) >= ATTEMPTS - 1 or (
                    bool(failed) and all(key(e) in tried for e in self._source.endpoints())
                )
                waits = self._routing.waits(k)
                try:
                    if ex.adapter is not None:
                        await self.adapters.ensure(endpoint, ex.adapter)
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
                        stream=ex.stream,
                        on_first_byte=lambda status: self._first_byte(ex, status),
                        waits=waits,
                        missing=ex.adapter is not None and not reloaded,
                    )
                    if ex.upstream_status in proxy.RETRYABLE:  # failed twice: passed through as is
                        self._source.report_failure(endpoint.id)
                    # 502 here: it failed mid-answer (reset, silence), after its first byte went out
                    self._routing.outcome(k, ok=ex.code != 502 and ex.upstream_status not in proxy.RETRYABLE)
                    return
                except proxy.Missing:
                    # The engine evicted the adapter since it was loaded there: again, once.
                    self.adapters.forget(endpoint.id, ex.adapter.name)
                    reloaded = again = True
                except proxy.Failed as exc:  # no answer at all (refused, reset, silent): tried elsewhere
                    self._source.report_failure(endpoint.id)
                    self._routing.outcome(k, ok=False)
                    if len(failed) >= ATTEMPTS - 1:
                        raise UpstreamError(str(exc)) from None
                finally:
                    self._routing.done_waiting(k)
                    self._slots.release(endpoint.id)
                    ex.held_s = (ex.held_s or 0.0) + max(0.0, self._clock() - acquired_at)
                if not again:  # an instance that failed: the retry goes elsewhere
                    failed = (*failed, key(endpoint))
                again = False
                endpoint = self._slots.try_acquire(failed, ex.prefix) or await self._hold(
                    ex, exclude=failed, front=True
                )
        except ActivatorError as exc:
            if not ex.reply.started:
                raise
            # A held stream (or a plain request kept alive with whitespace) already answered 200:
            # the error can only travel in the body, as an SSE event or as the JSON body itself.
            ex.code = exc.status
            if ex.reply.sse:
                await ex.reply.end(proxy.error_event(str(exc), exc.type, exc.code))
            else:
                await ex.reply.end(proxy.error_body(str(exc), exc.type, exc.code))

    def _queue_full(self) -> QueueFull:
        return QueueFull(self._config.retry_after_s, self._config.max_queued)

    async def _hold(self, ex: _Exchange, exclude: tuple[Key, ...], front: bool) -> Endpoint:
        """Wait for a slot in queue order (`Slots`), within `hold_deadline_s`; keep a held stream alive."""
        config = self._config
        if self._unavailable is not None:
            raise Unavailable(self._unavailable, config.retry_after_s)
        waiter = self._slots.hold(exclude, front, ex.owner, ex.prefix, ex.priority)
        self._source.poke()  # at once: the pool must not wait for its next tick
        self._queue_length.inc()
        (queue_band := self._queue_bands[band(ex.priority)]).inc()
        held_at = self._clock()
        interval = config.keepalive_interval_s if ex.stream else None
        if ex.whitespace:
            interval = config.plain_keepalive_interval_s
        next_keepalive = held_at + interval if interval is not None else math.inf
        taken = False
        try:
            while True:
                if waiter.future.done():
                    taken, ex.granted = True, self._clock()
                    return waiter.future.result()
                now = self._clock()
                deadline = held_at + self._hold_for()  # again each time: the expectation moves
                if now >= deadline:
                    raise DeadlineExceeded(config.retry_after_s, now - held_at)
                if now >= next_keepalive:
                    await ex.reply.keepalive(ex.cold, ex.stream)
                    next_keepalive += interval
                    continue
                # Not wait_for: a timeout must not cancel the future the dispatcher resolves.
                await asyncio.wait((waiter.future,), timeout=min(deadline, next_keepalive) - now)
        finally:
            if not taken:
                self._slots.abandon(waiter)
            self._queue_length.dec()
            queue_band.dec()
            self._queue_wait.observe(self._clock() - held_at)

    def _hold_for(self) -> float:
        """How long a request is held: `hold_deadline_s`, or longer when the source expects the start
        it waits on to take longer (`expected_start_s`: the tier's measured start) — START_SLACK
        times that, up to `hold_deadline_max_s`. A fixed 120 s refused the requests of a vLLM start
        that took 180 s, and their retries began again from nothing."""
        config = self._config
        expected = getattr(self._source, "expected_start_s", None)
        seconds = expected() if expected is not None else None
        if seconds is None or not math.isfinite(seconds) or seconds <= 0:
            return config.hold_deadline_s
        return max(config.hold_deadline_s, min(config.hold_deadline_max_s, seconds * START_SLACK))

    # -- sick instances leave routing (`routing.HealthRouting`) --------------------------------

    def ejected(self) -> list[str]:
        """The ids of the instances out of routing now for failing."""
        return self._routing.ejected()

    async def watch_health(self) -> None:
        """Probe the instances every `health_interval_s`, for ever (`HealthRouting.watch`)."""
        await self._routing.watch()

    async def check_health(self) -> None:
        """One round of probes (`HealthRouting.check`)."""
        await self._routing.check()

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
