"""LoRA adapters in the fleet simulator: many adapter deployments served by a few bases' instances.

An adapter deployment has no instances of its own (docs/guide/adapters.md): its base's instances
serve it, each loading the adapter at its first request there. Here:

1. A base is one deployment of the fleet (`warm_pool.fleet_sim`) whose trace is the union of its
   adapters' traces, each request tagged with its adapter, so its policy and tracker see the sum of
   their traffic, as the live base's do. The bases share the fleet's devices like any deployments.
2. A request goes to a free instance (READY, in routing, a slot free) that holds its adapter, the
   least busy of those, else to the least busy free one: the activator's adapter affinity, whose load
   bound is not modelled (an instance here takes at most `concurrency` requests).
3. The adapter tier: on an instance that does not hold the request's adapter, the request holds its
   slot and waits `InstanceModel.adapter_load_s` before its service begins. A request for an adapter
   whose load is under way there waits for the rest of that load (one load per instance and adapter).
4. The adapter's forecast: each request's adapter is named to the base's tracker, so the base's
   predictive policy forecasts each adapter on its own (`warm_pool.policies.adapter_forecast`), and
   the adapters its decision names are loaded ahead, each onto the least busy READY instance unless
   one holds it already (at most `max_adapters` a decision); every load is timed to the tracker's
   adapter tier (`TierTimes.adapter`), as the live pool's are. The live prefetcher picks the instance
   the adapter's affinity key would: here, as for requests, the bound is not modelled.
5. Each instance keeps at most `max_adapters` loaded (the platform's default, 4) and evicts the least
   recently used one that no request in flight on it holds, as the CPU engine does; when every loaded
   one is held, it keeps one more until a request ends (the engine would answer 503 `adapters_busy`
   and the activator retry: not modelled). An evicted adapter's next request there pays the load again.

Counted per adapter: requests, rejected, adapter loads (prefetches among them), requests that paid a load (waited for one,
their own or one under way), slow cold starts (served by an instance of the base that was started,
not woken, after the request arrived: the fleet simulator's definition) and waits (p50, p99).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from warm_pool import simulate as sim
from warm_pool.engine_settings import DEFAULT_MAX_ADAPTERS
from warm_pool.errors import InvalidConfig
from warm_pool.fleet_sim import (
    ASLEEP_RESIDUAL,
    FleetDeployment,
    FleetReport,
    FleetSimulation,
    _Deployment,
    _rounded,
)
from warm_pool.policies.base import ScalingConfig, Tier
from warm_pool.profiles import GPU, InstanceModel
from warm_pool.trace import TraceRequest

MAX_ADAPTERS = DEFAULT_MAX_ADAPTERS  # each instance's LRU of loaded adapters: `--max-adapters`'s default


@dataclass(frozen=True)
class Adapter:
    name: str
    base: str
    trace: tuple[TraceRequest, ...]


@dataclass(frozen=True)
class Base:
    name: str
    awake_bytes: int  # weights + KV budget of one instance
    asleep_bytes: int = ASLEEP_RESIDUAL
    policy: str = "predictive"


@dataclass(frozen=True)
class AdapterRow:
    name: str
    base: str
    requests: int
    rejected: int
    adapter_loads: int  # loads of this adapter onto an instance
    prefetched: int  # of those, made ahead of a request the policy expected
    paid_loads: int  # requests that waited for a load of it
    slow_cold_starts: int
    p50_wait_s: float
    p99_wait_s: float

    def summary(self) -> dict[str, object]:
        return {k: _rounded(getattr(self, k)) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class AdapterReport:
    fleet: FleetReport  # the bases as deployments of a fleet
    adapters: tuple[AdapterRow, ...]
    adapter_loads: int
    prefetched: int
    paid_loads: int
    adapter_evictions: int  # adapters evicted from an instance's LRU to load another
    slow_at: tuple[float, ...] = ()  # when each request that paid a slow cold start arrived

    def summary(self) -> dict[str, object]:
        out = self.fleet.summary()
        out |= {
            "adapter_loads": self.adapter_loads,
            "prefetched": self.prefetched,
            "paid_loads": self.paid_loads,
        }
        out |= {"adapter_evictions": self.adapter_evictions}
        return out | {"adapters": [a.summary() for a in self.adapters]}


class _Base(_Deployment):
    """A base deployment: a fleet deployment whose requests are tagged with their adapters."""

    def __init__(
        self, *args, tags: tuple[int, ...], names: tuple[str, ...], max_adapters: int, forecast: bool, **kw
    ) -> None:
        super().__init__(*args, **kw)
        self.tags, self.names, self.max_adapters, self.forecast = tags, names, max_adapters, forecast
        self._index = {name: n for n, name in enumerate(names)}
        adapters = len(names)
        self._loaded: dict[int, OrderedDict[int, float]] = {}  # instance → adapter → loaded at (LRU order)
        self._holding: dict[int, Counter[int]] = {}  # instance → adapter → requests in flight
        self.loads = [0] * adapters
        self.prefetched = [0] * adapters
        self.paid = [False] * len(self.trace)
        self.wait_of: list[float | None] = [None] * len(self.trace)
        self.evictions = 0

    def _on_arrival(self, i: int) -> None:
        if self.forecast:
            self.tracker.adapter_arrived(self._now, self.names[self.tags[i]])
        super()._on_arrival(i)

    def _decided(self, decision) -> None:
        """Load the adapters the decision names ahead of their requests (item 4 above)."""
        ready = [i for i in self._instances.values() if i.state == "ready" and i.leaving is None]
        for name in decision.adapters[: self.max_adapters] if ready else ():
            adapter = self._index.get(name)
            if adapter is None or any(adapter in self._loaded.get(i.id, ()) for i in ready):
                continue
            inst = min(ready, key=lambda i: i.busy)
            self._load(adapter, inst)
            self.prefetched[adapter] += 1

    def _load(self, adapter: int, inst) -> None:
        lru = self._loaded.setdefault(inst.id, OrderedDict())
        self.loads[adapter] += 1
        lru[adapter] = self._now + self.model.adapter_load_s
        self.tracker.adapter_loaded(self.model.adapter_load_s, self._now)
        self._evict(lru, self._holding.setdefault(inst.id, Counter()))

    def _free_instance(self, i: int):
        best = None
        for inst in self._instances.values():
            if inst.state == "ready" and inst.leaving is None and inst.busy < self.model.concurrency:
                holds = self.tags[i] in self._loaded.get(inst.id, ())
                if best is None or (not holds, inst.busy) < best[0]:
                    best = ((not holds, inst.busy), inst)
        return None if best is None else best[1]

    def _before_service(self, i: int, inst) -> float:
        adapter, now = self.tags[i], self._now
        lru = self._loaded.setdefault(inst.id, OrderedDict())
        holding = self._holding.setdefault(inst.id, Counter())
        holding[adapter] += 1
        loading = adapter not in lru
        if loading:
            self._load(adapter, inst)
        else:
            lru.move_to_end(adapter)
        delay = max(0.0, lru[adapter] - now)  # its own load, or the rest of one under way
        self.paid[i] = loading or delay > 0
        self.wait_of[i] = now - self.trace[i].t + delay
        return delay

    def _evict(self, lru: OrderedDict[int, float], holding: Counter[int]) -> None:
        while len(lru) > self.max_adapters:
            victim = next((a for a in lru if holding[a] == 0), None)
            if victim is None:
                return
            del lru[victim]
            self.evictions += 1

    def _on_done(self, data: object) -> None:
        i, inst_id, _ = data  # type: ignore[misc]
        holding = self._holding.get(inst_id)
        if holding is not None:
            holding[self.tags[i]] -= 1
        super()._on_done(data)

    def _remove(self, inst) -> None:
        super()._remove(inst)
        self._loaded.pop(inst.id, None)
        self._holding.pop(inst.id, None)


class _AdapterFleet(FleetSimulation):
    def __init__(self, bases: Sequence[FleetDeployment], tags: dict[str, tuple[int, ...]], **kw) -> None:
        self._tags, self._names = tags, kw.pop("names")
        self._max_adapters, self._forecast = kw.pop("max_adapters"), kw.pop("forecast")
        super().__init__(bases, **kw)

    def _deployment(self, spec: FleetDeployment, scaling: ScalingConfig, **kw) -> _Deployment:
        return _Base(
            self,
            spec,
            scaling,
            tags=self._tags[spec.name],
            names=self._names,
            max_adapters=self._max_adapters,
            forecast=self._forecast,
            **kw,
        )


def simulate_adapters(
    adapters: Sequence[Adapter],
    bases: Sequence[Base],
    *,
    devices: int,
    device_memory: int,
    model: InstanceModel = GPU,
    max_adapters: int = MAX_ADAPTERS,
    seed: int = 0,
    forecast: bool = True,
) -> AdapterReport:
    """Replay every adapter's trace on its base's instances, the bases sharing `devices` devices.
    Without `forecast` the bases' policies see only the sum of their adapters' traffic (no adapter
    is named to them): the baseline of the adapters' own forecast (bench/adapter_forecast_bench.py)."""
    if max_adapters < 1:
        raise InvalidConfig("max_adapters", f"max_adapters must be ≥ 1, got {max_adapters}")
    names = {b.name for b in bases}
    seen: set[str] = set()
    for a in adapters:
        if a.base not in names:
            raise InvalidConfig(a.name, f"adapter {a.name}: no base named {a.base!r}")
        if a.name in seen:
            raise InvalidConfig(a.name, f"adapter {a.name}: named twice")
        seen.add(a.name)
    specs, tags = [], {}
    for base in bases:
        # (t, adapter, position): the union in time order, ties in adapter order.
        mine = sorted(
            (req.t, n, k, req)
            for n, a in enumerate(adapters)
            if a.base == base.name
            for k, req in enumerate(a.trace)
        )
        if not mine:
            raise InvalidConfig(base.name, f"base {base.name}: no adapter with requests on it")
        tags[base.name] = tuple(n for _, n, _, _ in mine)
        trace = tuple(req for *_, req in mine)
        specs.append(FleetDeployment(base.name, trace, base.awake_bytes, base.asleep_bytes, base.policy))
    fleet = _AdapterFleet(
        specs,
        tags,
        names=tuple(a.name for a in adapters),
        max_adapters=max_adapters,
        forecast=forecast,
        devices=devices,
        device_memory=device_memory,
        mode="shared",
        model=model,
        seed=seed,
    )
    report = fleet.run()
    return _report(fleet, report, adapters)


def _report(fleet: _AdapterFleet, report: FleetReport, adapters: Sequence[Adapter]) -> AdapterReport:
    rows = []
    by_name = {dep.name: dep for dep in fleet.deployments}
    for n, a in enumerate(adapters):
        base: _Base = by_name[a.base]  # type: ignore[assignment]
        mine = [i for i, tag in enumerate(base.tags) if tag == n]
        waits = [base.wait_of[i] for i in mine if base.wait_of[i] is not None]
        slow = sum(1 for i in mine if base.cold_tiers[i] not in (None, Tier.WAKE))
        rows.append(
            AdapterRow(
                a.name,
                a.base,
                len(mine),
                sum(1 for i in mine if base.outcomes[i] == "rejected"),
                base.loads[n],
                base.prefetched[n],
                sum(1 for i in mine if base.paid[i]),
                slow,
                sim._percentile(waits, 50),  # type: ignore[arg-type]
                sim._percentile(waits, 99),  # type: ignore[arg-type]
            )
        )
    bases = [d for d in fleet.deployments if isinstance(d, _Base)]
    slow_at = sorted(
        b.trace[i].t for b in bases for i, tier in enumerate(b.cold_tiers) if tier not in (None, Tier.WAKE)
    )
    return AdapterReport(
        report,
        tuple(rows),
        sum(r.adapter_loads for r in rows),
        sum(r.prefetched for r in rows),
        sum(r.paid_loads for r in rows),
        sum(b.evictions for b in bases),
        tuple(slow_at),
    )
