"""Live cost: the instance-seconds the pools count, priced, per deployment and revision; the tokens
and requests the gateway answers; the share of instance-seconds spent idle.

    Pool (one per revision) ──▶ PoolCostTap ──▶ PoolMetrics        (stoker_instance_seconds_total)
                                     └────────▶ CostMeter ledgers   (stoker_cost_usd_total)
    gateway ─▶ CostMeter.tap(...) ─▶ MeterTap (a `limits.UsageTap`) ─▶ deployment.serve
    finally ─▶ CostMeter.done(tap) ─▶ tokens, requests, the arrival log (`stoker.control.arrival_log`)
    gateways of their own ─▶ reports ─▶ CostMeter.record / .remote_in_flight (`stoker.gateway.metering`)

**Cost.** Every instance-second a pool reports (`PoolMetrics.add_instance_seconds`, on each
transition and each tick) is priced at once by the revision's engine and the state it was spent
in (`stoker.control.prices`), times the devices each of its instances holds while awake (`gpus`: a
tensor-parallel instance on 2 GPUs costs two device-hours an hour; at least 1; asleep it holds
host memory, priced per instance), plus the revision's snapshot storage for as long as its pool runs (its bytes
× $/GB-month, accrued on each tick). So `stoker_cost_usd_total{deployment,revision,state}` is
`stoker_instance_seconds_total{deployment,state}` × price, split by revision (state `storage` for
the snapshot).

**Tokens.** `stoker_tokens_total{deployment,revision,direction}` (direction `in`, `out`): what
each 200 answer's `usage` reports (read as the rate limiter reads it, `UsageTap.tokens`); a stream
without usage (no `stream_options.include_usage`) counts the prompt's estimate (its body's bytes /
4) in and one token per event out. Requests to a cascade route are not counted (neither side is
the deployment the gateway routed by name); requests refused before a revision took them (429,
404) are not requests of any revision.

**Idle share** of a deployment = idle instance-seconds / all its instance-seconds (every state but
STOPPED), where idle = SLEEPING seconds + READY seconds with nothing in flight. The READY part is
∫ max(0, R(t) − n(t)) dt, R the deployment's READY instances (every revision's), n its requests
between arrival at the gateway and the end of their answers: the least-outstanding balancer puts
concurrent requests on distinct instances first, so with n requests and R instances, min(n, R) are
busy. It is kept as busy seconds ∫ min(n, R) dt, integrated exactly at every change of n or R
(held requests while R = 0 add nothing), and idle = READY + SLEEPING − busy. E.g. one instance
READY 100 s that answered 3 requests of 2 s each, one at a time, then asleep 50 s: busy 6 s, idle
94 + 50 = 144 s of 150 s, idle share 0.96.

**History.** Every amount goes into a total since the platform first ran on its data dir and into
per-minute buckets (by the platform's clock) of the last 24 h: `since` sums the buckets of the
minutes that began at or after now − since, rounded down to the minute (so `5m` covers 5 to 6
minutes). At most 1,441 buckets of a few numbers per revision. Both are checkpointed
(`stoker.control.checkpoint`, `checkpoint` and `restore`) and carried over a restart: each bucket
is written with the wall-clock time of its middle and put back into the minute of the new clock
that holds that time (the monotonic clock's origin moves with a reboot); buckets older than the
24 h window by then are dropped (their amounts stay in the totals). The Prometheus counters are
this process's, and start from zero, as counters do.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from stoker.control.arrival_log import LOG_DIR, ArrivalLog
from stoker.control.checkpoint import count, fields, items, label, number
from stoker.control.cost_rows import share_adapters, summarize
from stoker.control.prices import PriceTable
from stoker.gateway.limits import MeterTap
from stoker.spec.cost import HISTORY_S
from stoker.spec.deployment import NAME

_MINUTES = HISTORY_S // 60 + 1  # the current minute too
_UNCOUNTED = ("STOPPED",)
_AMOUNT = re.compile(
    r"(?:s|usd):[A-Za-z_]{1,32}|requests|tokens_in|tokens_out|busy_s|load_s"
)  # a ledger's names
_MOST_LEDGERS = 10_000


class Ledger:
    """Named amounts added over time: a total since start, and per-minute buckets of the last 24 h."""

    __slots__ = ("minutes", "total")

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.minutes: deque[tuple[int, dict[str, float]]] = deque(maxlen=_MINUTES)

    def add(self, now: float, amounts: Mapping[str, float]) -> None:
        minute = int(now // 60)
        if not self.minutes or self.minutes[-1][0] != minute:
            self.minutes.append((minute, {}))
        bucket = self.minutes[-1][1]
        for name, value in amounts.items():
            self.total[name] = self.total.get(name, 0.0) + value
            bucket[name] = bucket.get(name, 0.0) + value

    def to_doc(self, to_wall: float) -> dict[str, Any]:
        """JSON data: the total, and each minute's bucket by the wall-clock time of its middle
        (`to_wall`: wall − the platform's clock, now)."""
        return {
            "total": dict(self.total),
            "minutes": [[minute * 60 + 30 + to_wall, dict(bucket)] for minute, bucket in self.minutes],
        }

    @classmethod
    def from_doc(cls, doc: object, where: str, to_wall: float, now: float) -> Ledger:
        """What `to_doc` wrote, each bucket in the minute of this clock that holds its time (none in
        the future: the current minute at the latest), those older than the window dropped."""
        d = fields(doc, where, ("total", "minutes"))
        ledger = cls()
        ledger.total = _amounts(d["total"], f"{where}.total")
        current = int(now // 60)
        last = -math.inf
        for i, item in enumerate(items(d["minutes"], f"{where}.minutes", _MINUTES)):
            at, bucket = items(item, f"{where}.minutes[{i}]", 2, length=2)
            at = number(at, f"{where}.minutes[{i}][0]", low=None)
            if at <= last:
                raise ValueError(f"{where}.minutes[{i}]: the minutes must rise")
            last = at
            amounts = _amounts(bucket, f"{where}.minutes[{i}][1]")
            minute = min(current, math.floor((at - to_wall) / 60))
            if minute <= current - _MINUTES:
                continue  # older than the window: dropped (the total keeps it)
            if ledger.minutes and ledger.minutes[-1][0] == minute:
                merged = ledger.minutes[-1][1]
                for name, value in amounts.items():
                    merged[name] = merged.get(name, 0.0) + value
            else:
                ledger.minutes.append((minute, amounts))
        return ledger

    def sum(self, since_minute: int | None) -> dict[str, float]:
        """The total, or the sum of the buckets from `since_minute` on."""
        if since_minute is None:
            return dict(self.total)
        out: dict[str, float] = {}
        for minute, bucket in self.minutes:
            if minute >= since_minute:
                for name, value in bucket.items():
                    out[name] = out.get(name, 0.0) + value
        return out


def _amounts(value: object, where: str) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) > 64:
        raise ValueError(f"{where}: want an object of at most 64 amounts")
    return {label(k, where, _AMOUNT): number(v, f"{where}.{k}") for k, v in value.items()}


class _Load:
    """A deployment's busy-second integral: requests in flight (n) and READY instances (R)."""

    __slots__ = ("at", "in_flight", "ready", "remote")

    def __init__(self, now: float) -> None:
        self.in_flight = 0  # this process's gateway's
        self.remote: dict[str, int] = {}  # each gateway of its own's, as last reported
        self.ready: dict[str, int] = {}  # pool key -> READY
        self.at = now

    def advance(self, now: float) -> float:
        """Busy instance-seconds since the last change: min(n, R) × elapsed."""
        n = self.in_flight + sum(self.remote.values())
        busy = min(n, sum(self.ready.values())) * max(0.0, now - self.at)
        self.at = max(self.at, now)
        return busy


class CostMeter:
    """Prices what the pools report and counts what the gateway answers (see the module)."""

    def __init__(
        self,
        prices: PriceTable,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        snapshot_bytes: Callable[[str], int] = lambda snapshot_id: 0,
        arrivals: ArrivalLog | None = None,
        wall: Callable[[], float] = time.time,  # for the checkpoint's times
    ) -> None:
        self.prices = prices
        self._clock = clock
        self._wall = wall
        self._snapshot_bytes = snapshot_bytes
        self.arrivals = arrivals
        self._cost = Counter(
            "stoker_cost_usd",
            "Dollars spent by deployment, revision and instance state (storage: the snapshot), at the price table.",
            ["deployment", "revision", "state"],
            registry=registry,
        )
        self._tokens = Counter(
            "stoker_tokens",
            "Tokens answered by deployment, revision and direction (in: prompt, out: completion).",
            ["deployment", "revision", "direction"],
            registry=registry,
        )
        self._revisions: dict[tuple[str, int], Ledger] = {}
        self._deployments: dict[str, Ledger] = {}  # busy seconds
        self._loads: dict[str, _Load] = {}
        self._bases: dict[str, str] = {}  # adapter deployment -> the base its requests run on
        self._engines: dict[str, tuple[str, int]] = {}  # deployment -> (engine, devices), its latest pool's

    @classmethod
    def of_platform(
        cls,
        prices: PriceTable | None,
        registry: CollectorRegistry,
        clock: Callable[[], float],
        store: Any,
        data_dir: Path,
    ) -> CostMeter:
        """`stoker.control.platform.Platform`'s: list prices unless given, snapshot sizes from its store,
        the arrival log under its data dir."""
        arrivals = ArrivalLog(data_dir / LOG_DIR)
        return cls(prices or PriceTable(), registry, clock, store_bytes(store), arrivals)

    # ---- from the pools ------------------------------------------------------------------------------

    def pool_metrics(self, inner: Any, spec: Any) -> Any:
        """What the pool of revision `spec` (a `stoker.spec.deployment.DeploymentSpec`) reports to,
        instead of `inner` (a `PoolMetrics`)."""
        self._ledger(spec.name, spec.revision)
        size = self._snapshot_bytes(spec.snapshot_id)
        devices = max(1, spec.engine_settings.gpus or 0)
        self._engines[spec.name] = (spec.engine, devices)
        return PoolCostTap(inner, self, spec.name, spec.revision, spec.engine, size, devices)

    def _ledger(self, deployment: str, revision: int) -> Ledger:
        ledger = self._ledger_only(deployment, revision)
        if deployment not in self._loads:  # restored ledgers have none until their pool is here
            self._loads[deployment] = _Load(self._clock())
        return ledger

    def _ledger_only(self, deployment: str, revision: int) -> Ledger:
        """An adapter's ledger: it has no pool, so no busy integral of its own."""
        if (deployment, revision) not in self._revisions:
            self._revisions[(deployment, revision)] = Ledger()
            self._deployments.setdefault(deployment, Ledger())
        return self._revisions[(deployment, revision)]

    def instance_seconds(
        self, deployment: str, revision: int, engine: str, state: str, seconds: float, devices: int = 1
    ) -> None:
        if seconds <= 0 or state in _UNCOUNTED:
            return
        # Asleep, an instance holds host memory for its weights, not its devices.
        usd = seconds * self.prices.per_second(engine, state) * (1 if state == "SLEEPING" else devices)
        self._ledger(deployment, revision).add(self._clock(), {f"s:{state}": seconds, f"usd:{state}": usd})
        if usd > 0:
            self._cost.labels(deployment, str(revision), state).inc(usd)

    def storage(self, deployment: str, revision: int, size_bytes: int, seconds: float) -> None:
        usd = seconds * self.prices.storage_per_second(size_bytes)
        if usd > 0:
            self._ledger(deployment, revision).add(self._clock(), {"usd:storage": usd})
            self._cost.labels(deployment, str(revision), "storage").inc(usd)

    def ready_changed(self, deployment: str, pool: str, ready: int) -> None:
        load = self._loads.get(deployment)
        if load is None or load.ready.get(pool) == ready:
            return
        self._settle(deployment, load)
        load.ready[pool] = ready

    def _settle(self, deployment: str, load: _Load) -> None:
        now = self._clock()
        if busy := load.advance(now):
            self._deployments[deployment].add(now, {"busy_s": busy})

    # ---- from the gateway ----------------------------------------------------------------------------

    def adapter(self, name: str, base: str) -> None:
        """Adapter deployment `name` runs on deployment `base`: its requests keep the base's
        instances busy, and its rows take a share of the base's cost (`share_adapters`)."""
        self._bases[name] = base

    def adapter_loaded(self, name: str, revision: int, seconds: float) -> None:
        """One load of adapter `name`'s `revision` on an instance of its base, `seconds` long."""
        if seconds > 0:
            self._ledger_only(name, revision).add(self._clock(), {"load_s": seconds})

    def tap(self, send: Callable, name: str, prompt_estimate: int) -> MeterTap | None:
        """A tap for a request to deployment `name`; None for a name with no pool here (a cascade
        route). From here `done` follows in every case. An adapter's request is busy time of its
        base's instances."""
        on = self._bases.get(name, name)
        load = self._loads.get(on)
        if load is None:
            return None
        self._settle(on, load)
        load.in_flight += 1
        tap = _Metered(send, name, prompt_estimate, self._clock())
        tap.load = on
        return tap

    def done(self, tap: _Metered, scope: Mapping[str, Any]) -> None:
        name, on = tap.deployment, tap.load
        load = self._loads[on]
        self._settle(on, load)
        load.in_flight -= 1
        revision = scope.get("stoker.revision")
        if not isinstance(revision, int):
            return  # refused before a revision took it
        tokens_in, tokens_out = tap.tokens() or (0, 0)
        self.record(name, revision, tap.wall, tokens_in, tokens_out, tap.status or 499)

    def record(
        self, name: str, revision: int, wall: float, tokens_in: int, tokens_out: int, status: int
    ) -> None:
        """One answer of `revision`: its tokens, a request, a line of the arrival log. From `done`
        in one process; from the gateways' reports when they are processes of their own
        (`stoker.gateway.metering`)."""
        ledger = self._ledger_only(name, revision) if name in self._bases else self._ledger(name, revision)
        ledger.add(self._clock(), {"requests": 1, "tokens_in": tokens_in, "tokens_out": tokens_out})
        for direction, n in (("in", tokens_in), ("out", tokens_out)):
            if n:
                self._tokens.labels(name, str(revision), direction).inc(n)
        if self.arrivals is not None:
            self.arrivals.write(wall, name, revision, tokens_in, tokens_out, status)

    def remote_in_flight(self, name: str, gateway: str, n: int, live: frozenset[str]) -> None:
        """Gateway `gateway`'s requests to deployment `name` between arrival and the end of their
        answers, as it last reported; the gateways not `live` any more count none."""
        load = self._loads.get(name)
        if load is None:
            return
        self._settle(name, load)
        load.remote[gateway] = n
        for gone in [g for g in load.remote if g not in live]:
            del load.remote[gone]

    # ---- the checkpoint (`stoker.control.checkpoint`) -------------------------------------------------

    checkpoint_kind = "cost"

    def checkpoint(self) -> dict[str, Any]:
        """Every ledger, the busy seconds settled up to now, as JSON data."""
        for name, load in self._loads.items():
            self._settle(name, load)
        to_wall = self._wall() - self._clock()
        return {
            "revisions": [
                {"deployment": d, "revision": r, "ledger": ledger.to_doc(to_wall)}
                for (d, r), ledger in sorted(self._revisions.items())
            ],
            "deployments": [
                {"deployment": d, "ledger": ledger.to_doc(to_wall)}
                for d, ledger in sorted(self._deployments.items())
            ],
        }

    def restore(self, body: dict[str, Any]) -> None:
        """The ledgers of a previous run, before anything is counted here; all or nothing."""
        if self._revisions or self._deployments:
            raise RuntimeError("the cost meter restores before it counts anything")
        now = self._clock()
        to_wall = self._wall() - now
        doc = fields(body, "cost", ("revisions", "deployments"))
        revisions: dict[tuple[str, int], Ledger] = {}
        for i, entry in enumerate(items(doc["revisions"], "cost.revisions", _MOST_LEDGERS)):
            where = f"cost.revisions[{i}]"
            e = fields(entry, where, ("deployment", "revision", "ledger"))
            key = (
                label(e["deployment"], f"{where}.deployment", NAME),
                count(e["revision"], f"{where}.revision", low=1),
            )
            if key in revisions:
                raise ValueError(f"{where}: {key[0]} revision {key[1]} twice")
            revisions[key] = Ledger.from_doc(e["ledger"], f"{where}.ledger", to_wall, now)
        deployments: dict[str, Ledger] = {}
        for i, entry in enumerate(items(doc["deployments"], "cost.deployments", _MOST_LEDGERS)):
            where = f"cost.deployments[{i}]"
            e = fields(entry, where, ("deployment", "ledger"))
            name = label(e["deployment"], f"{where}.deployment", NAME)
            if name in deployments:
                raise ValueError(f"{where}: {name} twice")
            deployments[name] = Ledger.from_doc(e["ledger"], f"{where}.ledger", to_wall, now)
        for d, r in revisions:
            if d not in deployments:
                raise ValueError(f"cost.deployments: no ledger of {d}, whose revision {r} has one")
        self._revisions, self._deployments = revisions, deployments

    # ---- reading -------------------------------------------------------------------------------------

    def report(self, since_s: float | None = None) -> list[dict[str, Any]]:
        """One row per deployment (`summarize`), over the last `since_s` seconds or since start."""
        now = self._clock()
        for name, load in self._loads.items():
            self._settle(name, load)
        since_minute = None if since_s is None else int((now - since_s) // 60)
        rows = []
        for name in sorted(self._deployments):
            revisions = {
                r: ledger.sum(since_minute) for (d, r), ledger in sorted(self._revisions.items()) if d == name
            }
            rows.append(summarize(name, revisions, self._deployments[name].sum(since_minute)))
        return share_adapters(rows, self._bases, self._load_price)

    def _load_price(self, base: str) -> float:
        """Dollars a second of adapter load costs on an instance of `base`: a READY second of its
        engine on its devices."""
        engine, devices = self._engines.get(base, ("cpu", 1))
        return self.prices.per_second(engine, "READY") * devices


class PoolCostTap:
    """One pool's `PoolMetrics`, passed through, with its instance-seconds and READY count also
    told to the `CostMeter` under the pool's revision."""

    def __init__(
        self,
        inner: Any,
        meter: CostMeter,
        deployment: str,
        revision: int,
        engine: str,
        size: int,
        devices: int = 1,
    ) -> None:
        self._inner = inner
        self._meter = meter
        self._key = (deployment, revision, engine)
        self._size = size
        self._devices = devices  # each instance's: its seconds are priced that many times
        self._stored_at: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def add_instance_seconds(self, deployment: str, state: Any, seconds: float) -> None:
        self._inner.add_instance_seconds(deployment, state, seconds)
        name, revision, engine = self._key
        self._meter.instance_seconds(name, revision, engine, str(state.value), seconds, self._devices)

    def set_instances(self, pool: str, counts: Mapping[Any, int]) -> None:
        self._inner.set_instances(pool, counts)
        name, revision, _ = self._key
        self._meter.ready_changed(name, pool, sum(n for s, n in counts.items() if s.value == "READY"))
        now = self._meter._clock()
        if self._stored_at is not None and self._size:
            self._meter.storage(name, revision, self._size, now - self._stored_at)
        self._stored_at = now


def store_bytes(store: Any) -> Callable[[str], int]:
    """A snapshot's bytes in `store` (a `snapshots.SnapshotStore`): its manifest's files; 0 for
    one not in the store (in object storage only, not pulled yet)."""

    def size(snapshot_id: str) -> int:
        try:
            return sum(f.size for f in store.manifest(snapshot_id).files)
        except Exception:  # SnapshotError and its kin: nothing here to charge for
            return 0

    return size


class _Metered(MeterTap):
    __slots__ = ("load",)  # the deployment whose busy integral it is in: its own, or an adapter's base's
