"""A deployment as it runs: one unit (pool + activator) per revision that serves, warms or drains,
and the traffic split between them.

    Deployment "chat" ── traffic {3: 90, 4: 10} ──▶ Unit r3 (pool chat@3, activator)
                                                 └▶ Unit r4 (pool chat@4, activator)

Most of the time a deployment has one unit with all the traffic; `spec`, `pool`, `activator` and
`demand` name that one (the primary: most traffic, then newest). A second unit exists while a new
revision warms before the switch, while an old one drains after it, and while a canary runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from activator import Activator
from stoker.control.cluster import GatewayLoad
from stoker.gateway.revisions import RevisionStats, answer_on, pick_revision
from stoker.spec.deployment import DeploymentSpec
from warm_pool.pool import Pool


@dataclass
class Unit:
    """One revision's instances: its pool, and its activator (None in a controller, where the
    gateways hold the activators and `demand` sums what they report)."""

    spec: DeploymentSpec
    pool: Pool
    activator: Activator | None
    loop: asyncio.Task
    health: asyncio.Task | None
    demand: GatewayLoad | None = None

    def adapter_arrived(self, name: str) -> None:
        """A request for adapter deployment `name` on this revision's instances: its pool's."""
        self.pool.adapter_arrived(name)

    @property
    def ready(self) -> int:
        return len(self.pool.endpoints())

    def busy(self) -> bool:
        """Requests held or in flight here (from this process's activator, or the gateways')."""
        source = self.activator if self.activator is not None else self.demand
        if source is None:
            return False
        load = source.load()
        return load.queued > 0 or load.in_flight > 0


@dataclass
class Deployment:
    name: str
    latest: DeploymentSpec  # the newest revision's spec
    units: dict[int, Unit]
    traffic: dict[int, int]  # revision -> percent, summing to 100
    stats: RevisionStats
    clock: Callable[[], float] = time.monotonic
    notes: dict[int, str] = field(default_factory=dict)  # revision -> "warming", "failed: ...", ...
    switch: asyncio.Task | None = None  # a warm-before-switch under way
    leaving: dict[int, asyncio.Task] = field(default_factory=dict)  # units draining away
    closing: bool = False  # being removed, or the platform stops: traffic moves no more

    @property
    def primary(self) -> Unit:
        serving = [r for r in self.units if self.traffic.get(r)] or list(self.units)
        return self.units[max(serving, key=lambda r: (self.traffic.get(r, 0), r))]

    @property
    def spec(self) -> DeploymentSpec:
        return self.primary.spec

    @property
    def pool(self) -> Pool:
        return self.primary.pool

    @property
    def activator(self) -> Activator | None:
        return self.primary.activator

    @property
    def demand(self) -> GatewayLoad | None:
        return self.primary.demand

    def pools(self) -> list[Pool]:
        return [u.pool for u in self.units.values()]

    async def serve(self, scope, receive, send, body: bytes, parsed: dict, stream: bool, owner: str) -> None:
        """Answer one request on the revision the split gives it (or the one the admin pinned:
        `pin_revision`), with `x-stoker-revision`."""
        revision = pick_revision(self.name, self.traffic, self.units, scope, parsed)
        unit = self.units.get(revision) or self.primary  # a split names only revisions with units
        request = (scope, receive, send, body, parsed, stream, owner)
        await answer_on(unit.activator, unit.spec.revision, self.stats, self.clock, *request)

    def revision_rows(self, history: list[tuple[DeploymentSpec, float]]) -> list[dict[str, Any]]:
        """Every revision with its traffic share and state, for `stoker revisions`."""
        rows = []
        for spec, created in history:
            r = spec.revision
            unit = self.units.get(r)
            if r in self.notes:
                state = self.notes[r]
            elif self.traffic.get(r):
                state = "serving"
            elif r in self.leaving:
                state = "draining"
            elif unit is not None:
                state = "standby"
            else:
                state = "retired"
            rows.append(
                {
                    "revision": r,
                    "snapshot_id": spec.snapshot_id,
                    "model": spec.model,
                    "engine": spec.engine,
                    "traffic_percent": self.traffic.get(r, 0),
                    "state": state,
                    "ready": unit.ready if unit is not None else 0,
                    "created": created,
                    "settings": {
                        k: v for k, v in spec.to_dict().items() if k not in ("name", "revision", "model")
                    },
                }
            )
        return rows
