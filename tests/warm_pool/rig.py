"""One rig for the pool's tests on a fake clock: the real `Pool` and policy, on the in-memory
backend (`warm_pool.backends.memory`: the `Backend` that runs engines and the engine calls) and a
small in-memory `Demand` that stands in for the activator, so that a start, a sleep or a wake can
be made to fail, and an engine to die, on cue. The loop ticks only when poked (tick_s is an hour), and time moves only when the test
moves it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore, import_hf_dir
from tests.activator.conftest import eventually
from warm_pool.backends.base import Placement
from warm_pool.backends.memory import MemoryBackend
from warm_pool.metrics import PoolMetrics
from warm_pool.pool import Pool, PoolSpec
from warm_pool.snapshot import SnapshotSource


@dataclass
class Load:
    in_flight: int = 0
    queued: int = 0
    last_arrival: float | None = None
    outstanding: dict[str, int] = field(default_factory=dict)


@dataclass
class MemoryDemand:
    now: Load = field(default_factory=Load)
    changes: int = 0
    unavailable: list[str | None] = field(default_factory=list)  # every reason given, in order

    def load(self) -> Load:
        return self.now

    def capacity_changed(self) -> None:
        self.changes += 1

    def set_unavailable(self, reason: str | None) -> None:
        self.unavailable.append(reason)


@dataclass
class Rig:
    pool: Pool
    backend: MemoryBackend
    demand: MemoryDemand
    clock: list[float]
    registry: CollectorRegistry

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"deployment": "d", **labels}) or 0.0

    async def tick(self, at: float) -> None:
        """Move the clock to `at` and wait for the loop to decide (each decision is a new object)."""
        self.clock[0] = at
        before = self.pool.last_decision
        self.pool.poke()
        await eventually(lambda: self.pool.last_decision is not before)

    async def serve_one(self, at: float, seconds: float = 0.5) -> str:
        """A request arrives at `at` with nothing READY, is served by whatever comes up, and leaves."""
        self.clock[0] = at
        self.pool.request_arrived()
        self.demand.now.queued = 1
        await self.tick(at)
        await eventually(lambda: bool(self.pool.endpoints()))
        [instance] = self.pool.endpoints()
        self.demand.now.queued = 0
        self.clock[0] = at + seconds
        self.pool.request_finished(seconds, instance.id)
        return instance.id


@contextlib.asynccontextmanager
async def pool_rig(
    tmp_path: Path,
    model_dir: Path,
    backend: MemoryBackend | None = None,
    demand: MemoryDemand | None = None,
    **spec: object,
) -> AsyncIterator[Rig]:
    """A running pool of deployment "d" on the tiny model, on a clock at 0 that only the test moves.
    `spec` goes to `PoolSpec` (default grace period 5 s)."""
    store = SnapshotStore(tmp_path / "store")
    record = import_hf_dir(model_dir, store)
    registry, clock = CollectorRegistry(), [0.0]
    backend, demand = backend or MemoryBackend(), demand or MemoryDemand()
    pool = Pool(
        PoolSpec("d", SnapshotSource(store, record.id), **{"grace_period_s": 5, **spec}),
        backend,
        PoolMetrics(registry),
        engines=backend,
        clock=lambda: clock[0],
        tick_s=3600,  # ticks only when poked
    )
    pool.attach(demand)
    loop = asyncio.create_task(pool.run())
    try:
        yield Rig(pool, backend, demand, clock, registry)
    finally:
        await pool.close(drain=False)
        await loop


async def asleep(rig: Rig, at: float) -> None:
    await rig.tick(at)
    await eventually(lambda: rig.pool.counts()["SLEEPING"] == 1)


def at(instance_id: str, port: int = 0, *, deployment: str = "d", secret: str = "") -> Placement:
    """Where a test starts an engine by hand: loopback, `port` (0: it never serves HTTP)."""
    return Placement(instance_id, deployment, "", None, "cpu", 0, "127.0.0.1", port, secret)
