"""The pool's sleeping tier, step by step on a fake clock: the real `Pool` and policy, with small
in-memory stand-ins for its two narrow seams (the `Backend` that runs engines, the `Demand` that is
the activator), so that a sleep or a wake can be made to fail, and a process to die, on cue.

The loop ticks only when poked (tick_s is an hour), and time moves only when the test moves it.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore, import_hf_dir
from tests.activator.conftest import eventually
from warm_pool.errors import PoolError
from warm_pool.launch import LaunchSpec
from warm_pool.local import EngineCapabilities, ProcessHandle
from warm_pool.metrics import PoolMetrics
from warm_pool.policies.base import ScalingConfig
from warm_pool.pool import Pool, PoolSpec
from warm_pool.records import InstanceRecords
from warm_pool.snapshot import SnapshotSource


@dataclass
class MemoryBackend:
    """Engines that start at once and live until stopped or killed; sleep and wake succeed unless
    told to fail."""

    alive: set[ProcessHandle] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (action, url)
    fail: set[str] = field(default_factory=set)  # "sleep", "wake"
    sleep_levels: tuple[int, ...] = (1, 2)  # what its engines say they can do
    keys: set[str] = field(default_factory=set)  # the Authorization each engine call carried
    specs: list[LaunchSpec] = field(default_factory=list)
    pids: itertools.count = field(default_factory=lambda: itertools.count(1000))

    async def start(self, instance_id: str, spec: LaunchSpec) -> ProcessHandle:
        self.specs.append(spec)
        pid = next(self.pids)
        handle = ProcessHandle(pid, pid, 1)
        self.alive.add(handle)
        return handle

    def is_alive(self, handle: ProcessHandle) -> bool:
        return handle in self.alive

    async def wait_ready(self, handle, url, timeout_s, interval_s=0.1, *, health_path) -> None:
        return None

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None:
        self.alive.discard(handle)
        return 0

    async def read_startup_phases(
        self, url: str, instance_id: str | None = None, headers=None
    ) -> dict[str, float]:
        return {}

    async def read_capabilities(self, url: str, headers=None) -> EngineCapabilities:
        self.keys.add((headers or {}).get("authorization", ""))
        return EngineCapabilities(self.sleep_levels)

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

    def load(self) -> Load:
        return self.now

    def capacity_changed(self) -> None:
        self.changes += 1


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


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path):
    store = SnapshotStore(tmp_path / "store")
    record = import_hf_dir(tiny_model_dir, store)
    registry, clock = CollectorRegistry(), [0.0]
    backend, demand = MemoryBackend(), MemoryDemand()
    scaling = ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1)
    pool = Pool(
        PoolSpec("d", SnapshotSource(store, record.id), scaling=scaling, grace_period_s=5),
        backend,
        InstanceRecords(tmp_path / "instances"),
        PoolMetrics(registry),
        clock=lambda: clock[0],
        tick_s=3600,
    )
    pool.attach(demand)
    loop = asyncio.create_task(pool.run())
    yield Rig(pool, backend, demand, clock, registry)
    await pool.close(drain=False)
    await loop


async def asleep(rig: Rig, at: float) -> None:
    await rig.tick(at)
    await eventually(lambda: rig.pool.counts()["SLEEPING"] == 1)


async def test_an_idle_instance_sleeps_and_wakes_on_demand(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    assert rig.sample("stoker_cold_start_requests_total", tier="page_cache") == 1
    await asleep(rig, 5.0)
    assert rig.pool.endpoints() == [] and rig.backend.calls[-1][0] == "sleep"
    assert rig.pool.last_decision.ready == 0 and rig.pool.last_decision.sleeping == 1

    assert await rig.serve_one(20.0) == first  # woken, not started
    assert rig.backend.calls[-1][0] == "wake"
    assert rig.sample("stoker_cold_start_requests_total", tier="wake") == 1
    assert rig.sample("stoker_instance_startup_seconds_count", tier="wake") == 1
    assert rig.sample("stoker_instance_starts_total", outcome="ready") == 1
    assert rig.sample("stoker_instance_seconds_total", state="SLEEPING") == pytest.approx(15.0)


async def test_each_instance_gets_a_key_of_its_own_and_every_engine_call_carries_it(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    await asleep(rig, 5.0)
    assert await rig.serve_one(20.0) == first  # woken: capabilities, sleep and wake were all called
    [spec] = rig.backend.specs
    key = spec.env["STOKER_ENGINE_API_KEY"]
    assert len(key) >= 40 and key not in " ".join(spec.argv)
    assert rig.backend.keys == {f"Bearer {key}"}
    assert rig.pool.endpoints()[0].auth_headers == {"authorization": f"Bearer {key}"}


async def test_an_engine_without_sleep_is_stopped_when_idle_never_put_to_sleep(rig: Rig) -> None:
    rig.backend.sleep_levels = ()  # as vLLM's CPU build answers
    first = await rig.serve_one(0.0)
    assert rig.pool.can_sleep is False  # learned from the engine at READY
    await rig.tick(5.0)
    await eventually(lambda: not any(rig.pool.counts().values()))  # drained and stopped
    assert [action for action, _ in rig.backend.calls] == []  # no sleep was ever asked
    assert rig.pool.last_decision.sleeping == 0
    assert await rig.serve_one(20.0) != first  # a fresh start, not a wake
    assert rig.sample("stoker_cold_start_requests_total", tier="wake") == 0


async def test_a_failed_sleep_fails_the_instance_and_the_next_request_starts_another(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    rig.backend.fail.add("sleep")
    await rig.tick(5.0)
    await eventually(lambda: not any(rig.pool.counts().values()))  # FAILED, stopped, forgotten
    assert not rig.backend.alive
    assert rig.sample("stoker_instance_sleep_wake_total", action="sleep", outcome="failed") == 1
    assert rig.sample("stoker_instance_restarts_total") == 1
    # The replacement waits for the backoff (1 s after the failure), then starts on demand.
    assert await rig.serve_one(7.0) != first
    assert rig.sample("stoker_instance_starts_total", outcome="ready") == 2


async def test_a_failed_wake_fails_the_instance_and_a_fresh_one_serves(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    await asleep(rig, 5.0)
    rig.backend.fail.add("wake")
    rig.pool.request_arrived()
    rig.demand.now.queued = 1
    await rig.tick(20.0)
    await eventually(lambda: not any(rig.pool.counts().values()))  # the wake failed: FAILED, stopped
    assert rig.pool.endpoints() == []
    await rig.tick(22.0)  # after the backoff, a start takes its place
    await eventually(lambda: bool(rig.pool.endpoints()))
    [instance] = rig.pool.endpoints()
    assert instance.id != first
    rig.demand.now.queued = 0
    rig.pool.request_finished(0.5, instance.id)
    assert rig.sample("stoker_instance_sleep_wake_total", action="wake", outcome="failed") == 1
    assert rig.sample("stoker_cold_start_requests_total", tier="page_cache") == 2
    assert rig.sample("stoker_cold_start_requests_total", tier="wake") == 0


async def test_an_instance_waiting_to_sleep_is_taken_back_without_a_sleep_call(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    rig.demand.now.outstanding = {first: 1}  # a request still in flight when the policy says sleep
    await rig.tick(5.0)
    assert rig.pool.endpoints() == []  # out of routing at once, waiting for it
    rig.pool.request_arrived()
    rig.demand.now.queued = 1
    await rig.tick(5.5)
    assert [i.id for i in rig.pool.endpoints()] == [first]
    assert [a for a, _ in rig.backend.calls] == []  # never slept
    assert rig.pool.counts()["READY"] == 1


async def test_a_sleeping_process_that_dies_is_failed_and_close_stops_sleepers(rig: Rig) -> None:
    await rig.serve_one(0.0)
    await asleep(rig, 5.0)
    assert len(rig.backend.alive) == 1
    rig.backend.alive.clear()  # it died in its sleep
    await rig.tick(6.0)
    await eventually(lambda: rig.pool.counts()["SLEEPING"] == 0)
    assert rig.sample("stoker_instance_restarts_total") == 1

    await rig.serve_one(8.0)
    await asleep(rig, 30.0)  # idle longer than the longest gap seen (7.5 s) × 1.1
    await rig.pool.close()
    assert not rig.backend.alive
    assert rig.sample("stoker_instances", state="SLEEPING") == 0
