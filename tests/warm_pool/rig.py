"""One rig for the pool's tests on a fake clock: the real `Pool` and policy, with small in-memory
stand-ins for its narrow seams (the `Backend` that runs engines and the engine calls, the `Demand`
that is the activator), so that a start, a sleep or a wake can be made to fail, and an engine to
die, on cue. The loop ticks only when poked (tick_s is an hour), and time moves only when the test
moves it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore, import_hf_dir
from tests.activator.conftest import eventually
from warm_pool.backend import Placement, Running
from warm_pool.engine_calls import EngineCapabilities
from warm_pool.errors import PoolError
from warm_pool.launch import LaunchSpec
from warm_pool.metrics import PoolMetrics
from warm_pool.pool import Pool, PoolSpec
from warm_pool.procs import ProcessHandle
from warm_pool.reconcile import Observed
from warm_pool.snapshot import Acquired, SnapshotSource


@dataclass
class MemoryBackend:
    """Engines that start at once and live until stopped or killed; sleep and wake succeed unless
    told to fail. It is also the pool's engine calls (`Pool(engines=...)`)."""

    kind = "memory"
    alive: set[ProcessHandle] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (action, url)
    fail: set[str] = field(default_factory=set)  # "sleep", "wake"
    sleep_levels: tuple[int, ...] = (1, 2)  # what its engines say they can do
    keys: set[str] = field(default_factory=set)  # the Authorization each engine call carried
    specs: list[LaunchSpec] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    urls: dict[ProcessHandle, str] = field(default_factory=dict)
    pids: itertools.count = field(default_factory=lambda: itertools.count(1000))
    ports: itertools.count = field(default_factory=lambda: itertools.count(20000))
    observed: dict[str, Observed] = field(default_factory=dict)  # url → what its engine says of its sleep

    def engine_port(self, host: str) -> int:
        return next(self.ports)

    async def acquire(self, snapshot: SnapshotSource, holder: str) -> Acquired:
        return await snapshot.acquire(holder=holder)

    async def start(self, placement: Placement, spec: LaunchSpec) -> ProcessHandle:
        self.specs.append(spec)
        self.placements.append(placement)
        pid = next(self.pids)
        handle = ProcessHandle(pid, pid, 1, placement.instance_id)
        self.alive.add(handle)
        self.urls[handle] = f"http://{placement.host}:{placement.port}"
        return handle

    def is_alive(self, handle: ProcessHandle) -> bool:
        return handle in self.alive

    async def wait_ready(self, handle: ProcessHandle, timeout_s: float, *, health_path: str) -> str:
        return self.urls[handle]

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None:
        self.alive.discard(handle)
        return 0

    async def running(self) -> list[Running]:
        return []

    async def read_log(self, instance_id: str, max_bytes: int) -> str | None:
        return None

    async def aclose(self) -> None:
        return None

    async def read_startup_phases(
        self, url: str, instance_id: str | None = None, headers=None
    ) -> dict[str, float]:
        return {}

    async def read_capabilities(self, url: str, headers=None) -> EngineCapabilities:
        self.keys.add((headers or {}).get("authorization", ""))
        return EngineCapabilities(self.sleep_levels)

    async def observe_sleep(self, url: str, headers=None) -> Observed:
        return self.observed.get(url, Observed.AWAKE)

    async def sleep(self, url: str, level: int, timeout_s: float, headers=None) -> None:
        self.keys.add((headers or {}).get("authorization", ""))
        await self._call("sleep", url)

    async def wake_up(self, url: str, timeout_s: float, headers=None) -> None:
        self.keys.add((headers or {}).get("authorization", ""))
        await self._call("wake", url)

    async def _call(self, action: str, url: str) -> None:
        self.calls.append((action, url))
        await asyncio.sleep(0)
        if action in self.fail:
            raise PoolError(f"POST {url}: answered 500")


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
