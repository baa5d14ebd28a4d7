"""The controller's side of the two planes: what gateways learn from it, and what they tell it.

    gateway ──GET /cluster/v1/routes?gateway=G&epoch=E&after=V──▶ controller   (long poll)
            ◀── routing table: deployments, READY endpoints with their keys, tenant key hashes
    gateway ──POST /cluster/v1/load──▶ controller                                (every second,
            arrivals, completions, held and in-flight counts, failures, pokes     and at once on a poke)

As Knative's activators feed its autoscaler, each gateway reports its own load, and the controller
sums the live gateways' reports into the `Demand` each pool reads (`GatewayLoad`). A gateway whose
last report is older than `stale_after_s` is gone: its load no longer counts, and its share of
every instance's concurrency goes to the others.

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
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from activator.source import Load
from stoker.control.registry import NAME
from stoker.errors import invalid

UNIT = re.compile(NAME.pattern + r"@[1-9][0-9]{0,8}")  # a deployment's revision, as reports name it
MAX_REPORT_FINISHED = 10_000  # completions one report may carry (a second of a busy gateway's)
MAX_REPORT_EVENTS = 1000  # failures, and unhealthy instances, one report may carry
MAX_ID_LEN = 128


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
        live = self._live()
        routed = {i.id for i in self.pool.endpoints()} if self.pool is not None else set()
        outstanding: dict[str, int] = {}
        last = None
        for report in live:
            for ident, n in report.outstanding.items():
                outstanding[ident] = outstanding.get(ident, 0) + n
            for ident in report.routing - routed:  # it has not seen the instance leave yet
                outstanding[ident] = max(outstanding.get(ident, 0), 1)
            if report.since_arrival_s is not None:
                at = report.received_at - report.since_arrival_s
                last = at if last is None else max(last, at)
        return Load(
            in_flight=sum(r.in_flight for r in live),
            queued=sum(r.queued for r in live),
            last_arrival=last,
            outstanding=outstanding,
        )

    def capacity_changed(self) -> None:
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
        if body["poke"]:
            pool.poke()

    def _live(self) -> list[GatewayReport]:
        cutoff = self._clock() - self._table.stale_after_s
        return [r for r in self._reports.values() if r.received_at >= cutoff]


class RoutingTable:
    """The version gateways wait on, and which gateways are live (for the concurrency split)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, stale_after_s: float = 5.0) -> None:
        self.epoch = secrets.token_hex(8)
        self.version = 0
        self.stale_after_s = stale_after_s
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


def share(concurrency: int, gateways: list[str], gateway: str) -> int:
    """This gateway's part of an instance's concurrency: an even split, the remainder to the first
    in name order; at least 1 (with more gateways than slots, an instance may take a few more)."""
    if gateway not in gateways:
        gateways = sorted([*gateways, gateway])
    n = len(gateways)
    base, extra = divmod(concurrency, n)
    return max(1, base + (1 if gateways.index(gateway) < extra else 0))


def parse_gateway_id(value: object) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value) or len(value) > MAX_ID_LEN:
        raise invalid("'gateway' must be a name of letters, digits, '-', '_' or '.'.", "gateway")
    return value


def parse_report(body: Mapping[str, Any]) -> tuple[str, dict[str, dict[str, Any]]]:
    """`{"gateway": id, "deployments": {"name@revision": report}}`, every field checked (400
    naming it): one report per revision the gateway routes to."""
    gateway = parse_gateway_id(body.get("gateway"))
    deployments = body.get("deployments")
    if not isinstance(deployments, dict):
        raise invalid("'deployments' must be an object.", "deployments")
    return gateway, {name: _parse_one(name, r) for name, r in deployments.items()}


def _count(r: Mapping[str, Any], key: str, param: str | None = None) -> int:
    v = r.get(key, 0)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 1_000_000:
        raise invalid(f"'{param or key}' must hold integers from 0 to 1000000.", param or key)
    return v


def _ident(v: object, key: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_LEN:
        raise invalid(f"'{key}' must hold instance ids.", key)
    return v


def _seconds(v: object, key: str) -> float | None:
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise invalid(f"'{key}' must be a number of seconds >= 0 or null.", key)
    return float(v)


def _list(r: Mapping[str, Any], key: str, limit: int) -> list:
    v = r.get(key, [])
    if not isinstance(v, list) or len(v) > limit:
        raise invalid(f"'{key}' must be a list of at most {limit} items.", key)
    return v


def _parse_one(name: object, r: object) -> dict[str, Any]:
    if not isinstance(name, str) or not UNIT.fullmatch(name) or not isinstance(r, dict):
        raise invalid("'deployments' maps deployment@revision to reports.", "deployments")
    outstanding = r.get("outstanding", {})
    if not isinstance(outstanding, dict) or len(outstanding) > 10_000:
        raise invalid("'outstanding' must map instance ids to counts.", "outstanding")
    finished = []
    for item in _list(r, "finished", MAX_REPORT_FINISHED):
        if not isinstance(item, list) or len(item) != 2:
            raise invalid("'finished' holds [service_s, cold_on] pairs.", "finished")
        cold = None if item[1] is None else _ident(item[1], "finished")
        finished.append((_seconds(item[0], "finished"), cold))
    unhealthy = []
    for item in _list(r, "unhealthy", MAX_REPORT_EVENTS):
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], str):
            raise invalid("'unhealthy' holds [instance id, reason] pairs.", "unhealthy")
        unhealthy.append((_ident(item[0], "unhealthy"), item[1][:500]))
    answers = []
    for item in _list(r, "answers", MAX_REPORT_FINISHED):
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], int)
            or isinstance(item[0], bool)
            or not 100 <= item[0] <= 599
        ):
            raise invalid("'answers' holds [status, first_byte_s] pairs.", "answers")
        answers.append((item[0], _seconds(item[1], "answers")))
    usage = []
    for item in _list(r, "usage", MAX_REPORT_FINISHED):
        whole = isinstance(item, list) and len(item) == 4 and item[0] is not None
        whole = whole and all(isinstance(v, int) and not isinstance(v, bool) for v in item[1:])
        if not whole or not (0 <= min(item[1:3]) and max(item[1:3]) <= 10_000_000 and 100 <= item[3] <= 599):
            raise invalid("'usage' holds [wall, tokens_in, tokens_out, status] answers.", "usage")
        usage.append((_seconds(item[0], "usage"), item[1], item[2], item[3]))
    poke = r.get("poke", False)
    if not isinstance(poke, bool):
        raise invalid("'poke' must be a boolean.", "poke")
    return {
        "in_flight": _count(r, "in_flight"),
        "queued": _count(r, "queued"),
        "arrivals": _count(r, "arrivals"),
        "since_arrival_s": _seconds(r.get("since_arrival_s"), "since_arrival_s"),
        "outstanding": {_ident(k, "outstanding"): _count(outstanding, k, "outstanding") for k in outstanding},
        "routing": [_ident(i, "routing") for i in _list(r, "routing", 10_000)],
        "finished": finished,
        "failures": [_ident(i, "failures") for i in _list(r, "failures", MAX_REPORT_EVENTS)],
        "unhealthy": unhealthy,
        "answers": answers,
        "usage": usage,  # answers' tokens for the cost meter (`stoker.gateway.metering`)
        "poke": poke,
    }
