"""The controller's side of the two planes: what gateways learn from it, and what they tell it.

    gateway ──GET /cluster/v1/routes?gateway=G&epoch=E&after=V──▶ controller   (long poll)
            ◀── routing table: deployments, READY endpoints with their keys, tenant key hashes
    gateway ──POST /cluster/v1/load──▶ controller                                (every second,
            arrivals, completions, held and in-flight counts, failures, pokes     and at once on a poke)

As Knative's activators feed its autoscaler, each gateway reports its own load, and the controller
sums the live gateways' reports into the `Demand` each pool reads (`GatewayLoad`). A gateway whose
last report is older than `stale_after_s` is no longer live: its share of every instance's
concurrency goes to the others. Silence is not idleness, though: a gateway that was busy (requests
in flight or held) when it went silent may be cut off from the controller by the network, or the
controller stopped, while it goes on serving by its last table. For `silent_grace_s` its last load
still counts, as arriving now, so that no instance it routes to is scaled down meanwhile; after
that it is taken for gone, and its load no longer counts at all.

Per-instance concurrency is split between the live gateways (`share`): each routes at most its
share to an instance, so together they never send an instance more than it takes. An instance
that leaves routing still counts as busy (one outstanding request) for as long as a live gateway
reports routing to it: a drain waits until every gateway has seen it leave and finished its
requests there, not only the ones whose reports came in first.

The table has a version and the controller an `epoch` (random per start): a gateway asks for the
next version after the one it has, and a restarted controller answers at once. Nothing here
blocks: every answer is computed from memory.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from activator.source import Load

# A gateway busy when it went silent counts as busy this long (or 10 x the staleness bound): a
# partition or a stopped controller shorter than that scales nothing down under it.
SILENT_GRACE_S = 60.0


@dataclass
class GatewayReport:
    """One gateway's latest word on one deployment."""

    in_flight: int = 0
    queued: int = 0
    since_arrival_s: float | None = None  # seconds between its last arrival and its report
    outstanding: dict[str, int] = field(default_factory=dict)  # in flight per instance
    routing: frozenset[str] = frozenset()  # the instances it routes to now
    received_at: float = 0.0  # the controller's clock


class GatewayLoad:
    """One deployment's `Demand`, fed by every gateway's reports (`warm_pool.pool.Demand`)."""

    def __init__(self, deployment: str, table: RoutingTable, clock: Callable[[], float]) -> None:
        self.deployment = deployment
        self._table = table
        self._clock = clock
        self._reports: dict[str, GatewayReport] = {}
        self.unavailable: str | None = None
        self.pool: Any = None  # the pool it feeds (set by the platform): routing, arrivals, pokes

    # -- the pool's Demand ---------------------------------------------------------------------

    def load(self) -> Load:
        now = self._clock()
        live = self._live()
        fresh = {id(r) for r in live}
        # Busy when last heard of, silent since (within the grace): taken as busy, arriving now.
        silent = [
            r
            for r in self._reports.values()
            if id(r) not in fresh
            and (r.in_flight or r.queued)
            and now - r.received_at < self._table.silent_grace_s
        ]
        routed = {i.id for i in self.pool.endpoints()} if self.pool is not None else set()
        outstanding: dict[str, int] = {}
        last = now if silent else None
        for report in (*live, *silent):
            for ident, n in report.outstanding.items():
                outstanding[ident] = outstanding.get(ident, 0) + n
            for ident in report.routing - routed:  # it has not seen the instance leave yet
                outstanding[ident] = max(outstanding.get(ident, 0), 1)
        for report in live:
            if report.since_arrival_s is not None:
                at = report.received_at - report.since_arrival_s
                last = at if last is None else max(last, at)
        live = [*live, *silent]
        return Load(
            in_flight=sum(r.in_flight for r in live),
            queued=sum(r.queued for r in live),
            last_arrival=last,
            outstanding=outstanding,
        )

    def capacity_changed(self) -> None:
        self._table.bump()

    def expected_start_changed(self) -> None:
        """The pool's expected start changed (`Pool.expected_start_s`): the gateways' table carries it."""
        self._table.bump()

    def set_unavailable(self, reason: str | None) -> None:
        if reason != self.unavailable:
            self.unavailable = reason
            self._table.bump()

    # -- the gateways' side ----------------------------------------------------------------------

    def report(self, gateway: str, body: Mapping[str, Any], now: float) -> None:
        """One gateway's report for this deployment (validated by `parse_report`)."""
        self._reports[gateway] = GatewayReport(
            body["in_flight"],
            body["queued"],
            body["since_arrival_s"],
            dict(body["outstanding"]),
            frozenset(body["routing"]),
            now,
        )
        pool = self.pool
        if pool is None:
            return
        for _ in range(body["arrivals"]):
            pool.request_arrived()
        for service_s, cold_on in body["finished"]:
            pool.request_finished(service_s, cold_on)
        for ident in body["failures"]:
            pool.report_failure(ident)
        for ident, reason in body["unhealthy"]:
            pool.report_unhealthy(ident, reason)
        for name in body["adapters"]:
            pool.adapter_arrived(name)
        if body["poke"]:
            pool.poke()

    def _live(self) -> list[GatewayReport]:
        cutoff = self._clock() - self._table.stale_after_s
        return [r for r in self._reports.values() if r.received_at >= cutoff]


class RoutingTable:
    """The version gateways wait on, and which gateways are live (for the concurrency split)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        stale_after_s: float = 5.0,
        silent_grace_s: float | None = None,
    ) -> None:
        self.epoch = secrets.token_hex(8)
        self.version = 0
        self.stale_after_s = stale_after_s
        # how long a gateway busy when it went silent still counts as busy (`GatewayLoad.load`)
        self.silent_grace_s = (
            max(SILENT_GRACE_S, 10 * stale_after_s) if silent_grace_s is None else silent_grace_s
        )
        self._clock = clock
        self._changed = asyncio.Event()
        self._seen: dict[str, float] = {}  # gateway → when it last polled or reported

    def bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def seen(self, gateway: str) -> None:
        """A gateway polled or reported; a new one changes every gateway's share."""
        if not self.is_live(gateway):
            self._seen[gateway] = self._clock()
            self.bump()
        self._seen[gateway] = self._clock()

    def is_live(self, gateway: str) -> bool:
        at = self._seen.get(gateway)
        return at is not None and self._clock() - at < self.stale_after_s

    def live(self) -> list[str]:
        cutoff = self._clock() - self.stale_after_s
        for gone in [g for g, at in self._seen.items() if at < cutoff]:
            del self._seen[gone]
            self.bump()  # its share goes to the others
        return sorted(self._seen)

    async def wait(self, epoch: str | None, after: int, timeout_s: float) -> bool:
        """Until the table is newer than `after` of `epoch` (at once if another epoch): True; or
        False after `timeout_s`."""
        if epoch != self.epoch or self.version > after:
            return True
        changed = self._changed
        try:
            async with asyncio.timeout(timeout_s):
                await changed.wait()
        except TimeoutError:
            return False
        return True
