"""LoRA adapter deployments on the request path, in both planes: one request for an adapter is
answered on its base deployment's activator (`serve_on_base`), which loads the adapter on the
instance it picks (`activator.adapters`). In one process the adapters are the platform's
(`stoker.control.adapters`); in a gateway of its own they come with the routing table
(`RemoteAdapters`), each revision with what the activator needs: its snapshot, the directory the
instances read it from and the name their engine knows it by.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from activator.adapters import AdapterRef
from activator.balancer import point
from stoker.errors import APIError
from stoker.gateway.revisions import RevisionMetrics, RevisionStats, answer_on, pick_revision

LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class AdapterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "stoker_adapter_loads",
            "LoRA adapter loads on an instance of its base (each is the adapter's own cold start)",
            ["deployment", "base"],
            registry=registry,
        )
        self.load_seconds = Histogram(
            "stoker_adapter_load_seconds",
            "Seconds from asking an instance to load an adapter to its answer",
            ["deployment"],
            buckets=LOAD_BUCKETS,
            registry=registry,
        )
        self.prefetches = Counter(
            "stoker_adapter_prefetches",
            "LoRA adapter loads made ahead of a request the scaler expected (the adapter's pre-warm)",
            ["deployment"],
            registry=registry,
        )

    def listen(
        self, activator: Any, base: str, also: Callable[[str, float], None] = lambda name, seconds: None
    ) -> None:
        """Count the loads a base's activator makes, by the adapter deployment they were for, and
        tell `also` of each (the cost meter's side: priced here, or reported to the controller)."""
        activator.on_adapter_load = self.counter(base, also)

    def counter(self, base: str, also: Callable[[str, float], None]) -> Callable[[str, float], None]:
        """What hears of each load on `base`'s instances (by the engine's name for the adapter)."""

        def loaded(engine_name: str, seconds: float) -> None:
            name = engine_name.split("@")[0]
            self.loads.labels(name, base).inc()
            self.load_seconds.labels(name).observe(seconds)
            also(engine_name, seconds)

        return loaded


def adapter_ref(engine_name: str, path: str, snapshot_id: str) -> AdapterRef:
    return AdapterRef(engine_name, path, snapshot_id, point(snapshot_id))


async def serve_on_base(
    name: str,
    revision: int,
    ref: AdapterRef,
    base: Any,
    stats: RevisionStats,
    clock: Callable[[], float],
    request: tuple,
) -> tuple[int, float | None]:
    """One request for revision `revision` of adapter deployment `name`, on the revision of `base`
    (a `Deployment` or a gateway's `RemoteDeployment`) the base's split gives it, with `model` the
    engine's name for the adapter."""
    scope, receive, send, body, parsed, stream, owner = request
    if ref.name != parsed.get("model"):
        parsed = {**parsed, "model": ref.name}
        body = json.dumps(parsed).encode()
    base_revision = pick_revision(base.name, base.traffic, base.units, {}, parsed)
    unit = base.units.get(base_revision) or base.units[base.spec.revision]
    if unit.activator is None:
        raise APIError(
            503, f"The base {base.name!r} of {name!r} is served by the gateways.", code="base_elsewhere"
        )
    unit.adapter_arrived(name)  # for the adapter's own forecast on its base's pool
    return await answer_on(
        unit.activator, revision, stats, clock, scope, receive, send, body, parsed, stream, owner, adapter=ref
    )


@dataclass(frozen=True)
class RemoteAdapterSpec:
    """One revision of an adapter deployment, as the routing table gives it to a gateway."""

    name: str
    revision: int
    snapshot_id: str
    base: str
    path: str  # on the instances' machine
    engine_name: str
    log_requests: bool = False
    log_content: bool = False


@dataclass
class RemoteAdapter:
    name: str
    revisions: dict[int, RemoteAdapterSpec]
    traffic: dict[int, int]
    stats: RevisionStats
    base_of: Callable[[str], Any]
    clock: Callable[[], float] = time.monotonic

    @property
    def spec(self) -> RemoteAdapterSpec:
        return self.revisions[max(self.revisions, key=lambda r: (self.traffic.get(r, 0), r))]

    async def serve(self, scope, receive, send, body: bytes, parsed: dict, stream: bool, owner: str) -> None:
        revision = pick_revision(self.name, self.traffic, self.revisions, scope, parsed)
        spec = self.revisions[revision]
        base = self.base_of(spec.base)
        if base is None or not base.units:
            raise APIError(
                503, f"The base {spec.base!r} of {self.name!r} is not routed here.", code="base_gone"
            )
        ref = adapter_ref(spec.engine_name, spec.path, spec.snapshot_id)
        request = (scope, receive, send, body, parsed, stream, owner)
        await serve_on_base(self.name, revision, ref, base, self.stats, self.clock, request)


class RemoteAdapters:
    """A gateway's adapter deployments, as the controller's table last listed them."""

    def __init__(self, base_of: Callable[[str], Any], clock: Callable[[], float]) -> None:
        self._by_name: dict[str, RemoteAdapter] = {}
        self._base_of, self._clock = base_of, clock

    def get(self, name: str) -> RemoteAdapter | None:
        return self._by_name.get(name)

    def list(self) -> list[RemoteAdapter]:
        return list(self._by_name.values())

    def replace(self, table: Mapping[str, Any], metrics: RevisionMetrics) -> None:
        for name in [n for n in self._by_name if n not in table]:
            del self._by_name[name]
        for name, a in table.items():
            revisions = {
                int(r): RemoteAdapterSpec(
                    name,
                    int(r),
                    u["snapshot_id"],
                    u["base"],
                    u["path"],
                    u["engine_name"],
                    bool(u.get("log_requests", False)),
                    bool(u.get("log_content", False)),
                )
                for r, u in a["revisions"].items()
            }
            traffic = {int(r): int(p) for r, p in a["traffic"].items() if int(r) in revisions}
            current = self._by_name.get(name)
            if current is None:
                stats = RevisionStats(name, metrics, self._clock)
                self._by_name[name] = RemoteAdapter(
                    name, revisions, traffic, stats, self._base_of, self._clock
                )
            else:
                current.revisions, current.traffic = revisions, traffic
