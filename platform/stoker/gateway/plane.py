"""The data plane on its own (`stoker gateway`): each deployment's activator, fed by the routing
table the controller publishes, and its load reported back (`stoker.control.cluster` is the other side).

    controller ──routes (long poll)──▶ GatewayPlane ──▶ per deployment: Activator ◀── RemoteSource
               ◀──load (every second, at once on a poke)───────────────────────────┘

`RemoteSource` is the activator's `InstanceSource`, as the pool is in one process: its endpoints
are the table's, with this gateway's share of each instance's concurrency; what the activator
tells it (arrivals, completions, failures, pokes) is buffered and sent with the next report.
Without the controller the gateway goes on: it routes to the READY instances of its last table and
holds requests for deployments at zero (until their hold deadline), and keeps asking, with a
backoff; the buffered events wait for the next report that gets through (bounded: a long outage
drops the oldest completions, which only feed the scaler's statistics).

Tenant keys come with the table as SHA-256 hashes (`KeyTable`): a gateway never sees a key. Each
key's limits are split between the live gateways, so the sum over gateways is the key's limit.
Cascade routes come with it too (`stoker.gateway.routes.SyncedRoutes`), each with its small
deployment's context; the gateway serves that copy and never writes a route.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from activator import Activator, ActivatorConfig, ActivatorMetrics, Balance
from stoker.gateway.adapters import AdapterMetrics, RemoteAdapters
from stoker.gateway.metering import GatewayMeter, changed_samples
from stoker.gateway.revisions import RevisionMetrics, RevisionStats, answer_on, pick_revision
from stoker.gateway.routes import SyncedRoutes
from stoker.spec.keys import KeyRecord, Limits, hash_key
from stoker.spec.planes import MAX_REPORT_EVENTS, MAX_REPORT_FINISHED
from stoker.tls import TlsSettings, client_context, engines_context

log = logging.getLogger("stoker.gateway")
POLL_TIMEOUT_S = 20.0  # the controller holds a routes request this long when nothing changes
MAX_TABLE_BYTES = 16 << 20
# Kept for the next report while the controller is away: as many as one report may carry (more
# would be refused whole, and kept, for ever), the newest.
MAX_BUFFERED, MAX_REPORTED = MAX_REPORT_FINISHED, MAX_REPORT_EVENTS


@dataclass(frozen=True)
class RemoteEndpoint:
    id: str
    url: str
    max_concurrency: int
    auth_headers: dict[str, str]


@dataclass(frozen=True)
class RemoteSpec:
    name: str
    snapshot_id: str
    revision: int
    log_requests: bool = False  # the request log's (`stoker.gateway.request_log.Observer`)
    log_content: bool = False


class RemoteSource:
    """One deployment's `InstanceSource` in a gateway: the table's endpoints; the activator's news
    buffered for the controller."""

    def __init__(self, on_poke: Callable[[], None]) -> None:
        self._endpoints: list[RemoteEndpoint] = []
        self._on_poke = on_poke
        self.arrivals = 0
        self.finished: deque[list] = deque(maxlen=MAX_BUFFERED)
        self.failures: deque[str] = deque(maxlen=MAX_REPORTED)
        self.unhealthy: deque[list[str]] = deque(maxlen=MAX_REPORTED)
        self.answers: deque[list] = deque(maxlen=MAX_BUFFERED)  # [status, first byte s]: canary checks
        # [wall, in, out, status] (an adapter's: + [name, revision]): cost (`stoker.gateway.metering`)
        self.usage: deque[list] = deque(maxlen=MAX_BUFFERED)
        self.loads: deque[list] = deque(maxlen=MAX_REPORTED)  # [engine name, seconds]: adapters' loads
        # Adapter deployments requests arrived for, each once (their forecast: `Pool.adapter_arrived`).
        self.adapters: dict[str, None] = {}
        self.poked = False
        self._expected_start_s: float | None = None

    def endpoints(self) -> Sequence[RemoteEndpoint]:
        return self._endpoints

    def expected_start_s(self) -> float | None:
        """The controller's figure for the start a held request waits on (`Pool.expected_start_s`),
        as last sent: the activator holds requests by it, as in one process."""
        return self._expected_start_s

    def set_expected_start(self, seconds: object) -> None:
        """From the table: a positive finite number of seconds, or None (absent from an older
        controller, or no start known yet); anything else is None, and the hold deadline applies."""
        ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        self._expected_start_s = float(seconds) if ok and math.isfinite(seconds) and seconds > 0 else None

    def set_endpoints(self, endpoints: list[RemoteEndpoint]) -> None:
        self._endpoints = endpoints

    def poke(self) -> None:
        self.poked = True
        self._on_poke()

    def report_failure(self, endpoint_id: str) -> None:
        self.failures.append(endpoint_id)
        self._on_poke()

    def report_unhealthy(self, endpoint_id: str, reason: str) -> None:
        self.unhealthy.append([endpoint_id, reason])
        self._on_poke()

    def request_arrived(self) -> None:
        self.arrivals += 1

    def adapter_arrived(self, name: str) -> None:
        if name in self.adapters or len(self.adapters) < MAX_REPORTED:
            self.adapters[name] = None

    def request_finished(self, service_s: float | None, cold_on: str | None) -> None:
        self.finished.append([service_s, cold_on])

    def take(self) -> dict[str, Any]:
        """What happened since the last report, handed over (and forgotten here)."""
        news = {
            "arrivals": self.arrivals,
            "finished": list(self.finished),
            "failures": list(self.failures),
            "unhealthy": list(self.unhealthy),
            "answers": list(self.answers),
            "usage": list(self.usage),
            "loads": list(self.loads),
            "adapters": list(self.adapters),
            "poke": self.poked,
        }
        self.arrivals, self.poked, self.adapters = 0, False, {}
        for buffer in (self.finished, self.failures, self.unhealthy, self.answers, self.usage, self.loads):
            buffer.clear()
        return news

    def give_back(self, news: dict[str, Any]) -> None:
        """A report that did not get through: its news goes into the next one."""
        self.arrivals += news["arrivals"]
        self.finished.extendleft(reversed(news["finished"]))
        self.failures.extendleft(reversed(news["failures"]))  # older than what came since: dropped first
        self.unhealthy.extendleft(reversed(news["unhealthy"]))
        self.answers.extendleft(reversed(news["answers"]))
        self.usage.extendleft(reversed(news["usage"]))
        self.loads.extendleft(reversed(news["loads"]))
        for name in news["adapters"]:
            self.adapter_arrived(name)
        self.poked = self.poked or news["poke"]


@dataclass
class RemoteUnit:
    """One revision of a deployment, as a gateway routes to it."""

    spec: RemoteSpec
    activator: Activator
    source: RemoteSource
    health: asyncio.Task

    def adapter_arrived(self, name: str) -> None:
        """A request for adapter deployment `name` on this revision's instances: reported."""
        self.source.adapter_arrived(name)


@dataclass
class RemoteDeployment:
    """A deployment in a gateway: an activator per revision, and the controller's traffic split."""

    name: str
    units: dict[int, RemoteUnit]
    traffic: dict[int, int]
    stats: RevisionStats
    clock: Callable[[], float] = time.monotonic

    @property
    def spec(self) -> RemoteSpec:
        """The primary revision's (most traffic): what `/v1/models` shows."""
        revision = max(self.units, key=lambda r: (self.traffic.get(r, 0), r))
        return self.units[revision].spec

    async def serve(self, scope, receive, send, body: bytes, parsed: dict, stream: bool, owner: str) -> None:
        """Answer one request on the revision the split gives it (or the one the admin pinned), as
        `Deployment.serve` does."""
        revision = pick_revision(self.name, self.traffic, self.units, scope, parsed)
        unit = self.units.get(revision) or self.units[self.spec.revision]
        request = (scope, receive, send, body, parsed, stream, owner)
        status, ttft_s = await answer_on(unit.activator, unit.spec.revision, self.stats, self.clock, *request)
        unit.source.answers.append([status, ttft_s])

    def close(self, why: str) -> None:
        for unit in self.units.values():
            unit.health.cancel()
            unit.source.set_endpoints([])
            unit.activator.set_unavailable(why)


class KeyTable:
    """Tenant keys by hash, as the controller sent them: what `KeyAuth` needs of a `KeyStore`."""

    def __init__(self) -> None:
        self._by_hash: dict[str, KeyRecord] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: str) -> KeyRecord | None:
        return self._by_hash.get(hash_key(key))

    def replace(self, keys: list[dict[str, Any]], gateways: int) -> None:
        table = {}
        for k in keys:
            limits = _split(
                Limits(
                    k.get("rps"),
                    k.get("tpm"),
                    k.get("max_concurrent"),
                    k.get("priority"),
                    k.get("priority_min"),
                ),
                gateways,
            )
            record = KeyRecord(k["id"], k["tenant"], tuple(k["deployments"]), k["created"], limits)
            table[k["hash"]] = record
        self._by_hash = table


def _split(limits: Limits, gateways: int) -> Limits:
    """One gateway's part of a key's limits: the sum over the live gateways is the key's limit."""
    n = max(1, gateways)
    return Limits(
        None if limits.rps is None else limits.rps / n,
        None if limits.tpm is None else max(1, limits.tpm // n),
        None if limits.max_concurrent is None else max(1, math.ceil(limits.max_concurrent / n)),
        limits.priority,  # a class, not an amount: the same on every gateway
        limits.priority_min,
    )


@dataclass
class GatewayPlane:
    """Every deployment the controller routes, with its activator; the two loops that keep them."""

    controller: str  # base URL
    admin_key: str | None
    gateway_id: str
    activator_config: ActivatorConfig
    metrics_registry: CollectorRegistry
    report_interval_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    tls: TlsSettings | None = None  # verifies the controller and the engines (`stoker.tls`)
    keys: KeyTable = field(default_factory=KeyTable)
    cascade_routes: SyncedRoutes = field(default_factory=SyncedRoutes)  # the controller's, as last sent
    adapters: RemoteAdapters | None = None  # the LoRA adapter deployments, as last sent
    adapter_metrics: AdapterMetrics | None = None
    _deployments: dict[str, RemoteDeployment] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = None  # the proxy's, to the engines
    _control: aiohttp.ClientSession | None = None  # to the controller, with this gateway's key
    _passthrough: aiohttp.ClientSession | None = None  # to the controller, with the caller's key only
    metrics: ActivatorMetrics | None = None
    revision_metrics: RevisionMetrics | None = None
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _report_now: asyncio.Event = field(default_factory=asyncio.Event)
    _epoch: str | None = None
    _version: int = -1
    synced: asyncio.Event = field(default_factory=asyncio.Event)  # a first table arrived
    controller_reachable: bool = False
    controller_error: str | None = None  # why the last poll failed, for /healthz (a refused certificate)
    cost: GatewayMeter | None = None  # answers' tokens, reported (`stoker.gateway.metering`)
    _sent: dict = field(default_factory=dict)  # the dashboard's series as the controller has them

    def __post_init__(self) -> None:
        self.cost = GatewayMeter(self, self.clock)
        self.adapters = RemoteAdapters(self._deployments.get, self.clock)

    # -- what the data routes need (as `Platform` gives them in one process) -----------------------

    def get(self, name: str) -> Any:
        """A deployment of a model (a `RemoteDeployment`) or of an adapter (a `RemoteAdapter`)."""
        return self._deployments.get(name) or self.adapters.get(name)

    def list(self) -> list[RemoteDeployment]:
        return list(self._deployments.values())

    # -- lifecycle ------------------------------------------------------------------------------------

    def passthrough_session(self) -> aiohttp.ClientSession:
        return self._passthrough

    async def start(self) -> None:
        self.metrics = ActivatorMetrics(self.metrics_registry)
        self.revision_metrics = RevisionMetrics(self.metrics_registry)
        self.adapter_metrics = AdapterMetrics(self.metrics_registry)
        to_controller = client_context(self.tls)  # the one context for every call to the controller
        self._passthrough = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=to_controller), auto_decompress=False
        )
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ssl=engines_context(self.tls))
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        headers = {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        self._control = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=to_controller),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._tasks = [
            asyncio.create_task(self._follow(), name="gateway-routes"),
            asyncio.create_task(self._report_loop(), name="gateway-reports"),
        ]

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for d in self._deployments.values():
            for unit in d.units.values():
                unit.health.cancel()
        self._deployments.clear()
        for session in (self._session, self._control, self._passthrough):
            if session is not None:
                await session.close()

    # -- the routing table ------------------------------------------------------------------------------

    async def _follow(self) -> None:
        """Long-poll the controller's table for ever; keep the last one while it is away."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((aiohttp.ClientError, TimeoutError, ValueError)),
            wait=wait_exponential(multiplier=0.2, max=5.0),
        ):
            with attempt:
                while True:
                    table = await self._poll()
                    self.controller_reachable, self.controller_error = True, None
                    try:
                        self._apply(table)
                    except (KeyError, TypeError, AttributeError) as exc:  # retried, as a failed poll
                        raise ValueError(f"malformed routing table: {exc!r}") from None
            if attempt.retry_state.outcome is not None and attempt.retry_state.outcome.failed:
                self.controller_reachable = False
                exc = attempt.retry_state.outcome.exception()
                self.controller_error = _why(exc)
                log.warning(
                    "controller %s unreachable (%s); routing by the last table",
                    self.controller,
                    self.controller_error,
                )

    async def _poll(self) -> dict[str, Any]:
        params = {"gateway": self.gateway_id, "after": str(self._version)}
        if self._epoch is not None:
            params["epoch"] = self._epoch
        timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S + 10, sock_connect=5)
        async with self._control.get(
            self.controller + "/cluster/v1/routes", params=params, timeout=timeout
        ) as r:
            body = await r.content.read(MAX_TABLE_BYTES + 1)
            if r.status != 200 or len(body) > MAX_TABLE_BYTES:
                raise ValueError(f"routes answered {r.status}: {body[:200]!r}")
            return json.loads(body)

    def _apply(self, table: dict[str, Any]) -> None:
        if table["epoch"] != self._epoch:  # a controller (re)started: it has none of our series
            self._sent.clear()
        self._epoch, self._version = table["epoch"], table["version"]
        self.keys.replace(table["keys"], table["gateways"])
        self.cascade_routes.replace(table.get("cascades", []))  # none from a controller before routes
        wanted = table["deployments"]
        for name in [n for n in self._deployments if n not in wanted]:
            self._deployments.pop(name).close(f"deployment {name!r} was removed")
        for name, d in wanted.items():
            current = self._deployments.get(name)
            if current is None:
                stats = RevisionStats(name, self.revision_metrics, self.clock)
                current = self._deployments[name] = RemoteDeployment(name, {}, {}, stats, self.clock)
            units = {int(r): u for r, u in d["units"].items()}
            for revision in [r for r in current.units if r not in units]:  # retired at the controller
                gone = current.units.pop(revision)
                gone.health.cancel()
                gone.source.set_endpoints([])
                gone.activator.set_unavailable(f"revision {revision} of {name!r} was retired")
            for revision, u in units.items():
                unit = current.units.get(revision)
                spec = RemoteSpec(
                    name,
                    u["snapshot_id"],
                    revision,
                    bool(u.get("log_requests", False)),  # absent from a controller before the log
                    bool(u.get("log_content", False)),
                )
                if unit is None or unit.spec != spec:
                    if unit is not None:
                        unit.health.cancel()
                    unit = current.units[revision] = self._make(spec)
                endpoints = [
                    RemoteEndpoint(
                        e["id"], e["url"], e["max_concurrency"], {"authorization": f"Bearer {e['key']}"}
                    )
                    for e in u["endpoints"]
                ]
                unit.source.set_endpoints(endpoints)
                unit.source.set_expected_start(u.get("expected_start_s"))
                unit.activator.set_balance(Balance(u["balance"], u["affinity_bound"]))
                # absent from an older controller: then no priority goes upstream, which every engine takes
                unit.activator.set_engine_priority(bool(u.get("engine_priority", False)))
                unit.activator.set_unavailable(u["unavailable"])
                unit.activator.capacity_changed()
            current.traffic = {int(r): p for r, p in d["traffic"].items() if int(r) in current.units}
        self.adapters.replace(
            table.get("adapters", {}), self.revision_metrics
        )  # none from an older controller
        self.synced.set()

    def _make(self, spec: RemoteSpec) -> RemoteUnit:
        source = RemoteSource(self._report_now.set)
        activator = Activator(
            spec.name, source, self.activator_config, self._session, self.metrics, clock=self.clock
        )
        health = asyncio.create_task(activator.watch_health(), name=f"health-{spec.name}@{spec.revision}")
        # the loads of the adapters it serves, counted here and reported for the controller to price
        self.adapter_metrics.listen(
            activator, spec.name, also=lambda name, seconds: source.loads.append([name, round(seconds, 6)])
        )
        return RemoteUnit(spec, activator, source, health)

    # -- reports ----------------------------------------------------------------------------------------

    async def _report_loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.report_interval_s):
                    await self._report_now.wait()
            except TimeoutError:
                pass
            self._report_now.clear()
            await self._report()

    async def _report(self) -> None:
        now, taken, body = self.clock(), {}, {}
        units = {f"{u.spec.name}@{r}": u for d in self._deployments.values() for r, u in d.units.items()}
        for key, unit in units.items():
            load = unit.activator.load()
            news = taken[key] = unit.source.take()
            since = None if load.last_arrival is None else max(0.0, now - load.last_arrival)
            body[key] = {
                "in_flight": load.in_flight,
                "queued": load.queued,
                "since_arrival_s": since,
                "outstanding": dict(load.outstanding),
                "routing": [e.id for e in unit.source.endpoints()],
                **news,
            }
        series = changed_samples(self.metrics_registry, self._sent)  # for the dashboard
        try:
            async with self._control.post(
                self.controller + "/cluster/v1/load",
                json={"gateway": self.gateway_id, "deployments": body, "series": series},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as r:
                if r.status != 200:
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            self._sent.update({(name, tuple(sorted(labels.items()))): v for name, labels, v in series})
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("report not delivered: %s", exc)
            for key, news in taken.items():
                units[key].source.give_back(news)


def _why(exc: BaseException) -> str:
    """A failed poll's cause in one line; a certificate the CA does not vouch for says so."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"TLS: the controller's certificate was refused: {exc.certificate_error}"
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS: {exc}"
    return f"{type(exc).__name__}: {exc}"[:300]
