"""The pool recycling instances past their maximum age (`warm_pool.recycle`, `warm_pool.recycler`),
step by step on a fake clock (`tests.warm_pool.rig`): the replacement READY first, the old one
drained after, one at a time, and with shared device memory only where the replacement fits.

Every change of the routing set is sampled where the activator hears of it
(`Demand.capacity_changed`), so "never fewer READY than before" is checked at every moment the
count can change, not at moments a test happens to look."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore, import_hf_dir
from tests.activator.conftest import eventually
from tests.warm_pool.rig import MemoryDemand, Rig, pool_rig
from warm_pool.backends.memory import MemoryBackend
from warm_pool.fleet import Devices, Fleet, Footprint
from warm_pool.metrics import PoolMetrics
from warm_pool.policies.base import ScalingConfig
from warm_pool.pool import Pool, PoolSpec
from warm_pool.snapshot import SnapshotSource

MIB = 1 << 20
MAX_AGE_S = 100.0  # due 90-100 s after READY first (10 % jitter)


@dataclass
class CountingDemand(MemoryDemand):
    """The activator's stand-in, noting the READY instances in routing each time it is told."""

    pool: Pool | None = None
    routed: list[frozenset[str]] = field(default_factory=list)

    def capacity_changed(self) -> None:
        super().capacity_changed()
        if self.pool is not None:
            self.routed.append(frozenset(i.id for i in self.pool.endpoints()))


async def settled(rig: Rig, at: float, ready: int) -> None:
    """Tick at `at` and wait for `ready` READY routing instances and nothing starting or draining."""
    await rig.tick(at)

    def quiet() -> bool:
        counts = rig.pool.counts()
        return len(rig.pool.endpoints()) == ready and not (
            counts["PENDING"] or counts["STARTING"] or counts["DRAINING"]
        )

    await eventually(quiet)


async def test_instances_past_their_age_are_replaced_one_at_a_time_never_below_the_count(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    demand = CountingDemand()
    scaling = ScalingConfig(min_warm=2, max=2, idle_timeout_s=600, stable_window_s=1)
    async with pool_rig(
        tmp_path, tiny_model_dir, demand=demand, scaling=scaling, max_instance_age_s=MAX_AGE_S
    ) as rig:
        demand.pool = rig.pool
        await settled(rig, 0.0, 2)
        first = {i.id for i in rig.pool.endpoints()}
        assert [e["age_s"] for e in rig.pool.instances()] == [0.0, 0.0]
        await settled(rig, 50.0, 2)  # not due yet
        assert {i.id for i in rig.pool.endpoints()} == first

        t = 100.0
        while rig.pool.last_decision is not None and (first & {i.id for i in rig.pool.endpoints()}):
            await rig.tick(t)
            await eventually(lambda: not rig.pool.counts()["PENDING"] and not rig.pool.counts()["STARTING"])
            await eventually(lambda: not rig.pool.counts()["DRAINING"])
            t += 1.0
            assert t < 120.0, "not recycled within a few ticks of their age"

        now = {i.id for i in rig.pool.endpoints()}
        assert len(now) == 2 and not (now & first)  # both replaced
        assert rig.sample("stoker_instance_recycles_total", outcome="replaced") == 2
        sizes = [len(ids) for ids in demand.routed if ids]
        assert min(len(ids) for ids in demand.routed[demand.routed.index(frozenset(first)) :]) >= 2
        assert max(sizes) == 3  # max + 1, never more: one replacement at a time
        assert rig.sample("stoker_instance_starts_total", outcome="ready") == 4
        assert all(e["age_s"] < MAX_AGE_S for e in rig.pool.instances())


async def test_recycling_is_off_by_default(tmp_path: Path, tiny_model_dir: Path) -> None:
    scaling = ScalingConfig(min_warm=1, max=1, idle_timeout_s=600, stable_window_s=1)
    async with pool_rig(tmp_path, tiny_model_dir, scaling=scaling) as rig:
        await settled(rig, 0.0, 1)
        [first] = rig.pool.endpoints()
        await settled(rig, 10_000.0, 1)
        assert rig.pool.endpoints() == [first]
        assert rig.pool.instances()[0]["age_s"] == 10_000.0


@contextlib.asynccontextmanager
async def fleet_rig(tmp_path: Path, model_dir: Path, device_mib: int, **spec: object):
    """`pool_rig` with one shared device of `device_mib` and 64 MiB instances."""
    store = SnapshotStore(tmp_path / "store")
    record = import_hf_dir(model_dir, store)
    registry, clock = CollectorRegistry(), [0.0]
    backend, demand = MemoryBackend(), CountingDemand()
    fleet = Fleet(Devices.cpu_budget(device_mib * MIB), registry)
    pool = Pool(
        PoolSpec(
            "d", SnapshotSource(store, record.id), grace_period_s=5, footprint=Footprint(64 * MIB, 0), **spec
        ),
        backend,
        PoolMetrics(registry),
        engines=backend,
        clock=lambda: clock[0],
        tick_s=3600,
        fleet=fleet,
    )
    pool.attach(demand)
    demand.pool = pool
    loop = asyncio.create_task(pool.run())
    try:
        yield Rig(pool, backend, demand, clock, registry)
    finally:
        await pool.close(drain=False)
        await loop


@pytest.mark.parametrize(("device_mib", "recycled"), [(128, False), (192, True)])
async def test_a_replacement_waits_for_device_memory_and_the_old_one_serves_meanwhile(
    tmp_path: Path, tiny_model_dir: Path, device_mib: int, recycled: bool
) -> None:
    scaling = ScalingConfig(min_warm=2, max=2, idle_timeout_s=600, stable_window_s=1)
    async with fleet_rig(
        tmp_path, tiny_model_dir, device_mib, scaling=scaling, max_instance_age_s=MAX_AGE_S
    ) as rig:
        await settled(rig, 0.0, 2)
        first = {i.id for i in rig.pool.endpoints()}
        for t in range(100, 106):
            await settled(rig, float(t), 2)
            assert rig.pool.counts()["READY"] >= 2
        still = {i.id for i in rig.pool.endpoints()} & first
        if recycled:  # room for a third: both replaced, one after the other
            assert not still and rig.sample("stoker_instance_recycles_total", outcome="replaced") == 2
            assert rig.sample("stoker_instance_recycles_total", outcome="no_room") == 0
        else:  # two fill the device: the first recycle waits, counted once, and nothing is lost
            assert still == first
            assert rig.sample("stoker_instance_recycles_total", outcome="no_room") == 1
            assert rig.sample("stoker_instance_recycles_total", outcome="replaced") == 0
        assert all(len(ids) >= 2 for ids in rig.demand.routed[1:])


async def test_a_sleeping_instance_is_woken_as_the_replacement_rather_than_a_start(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    scaling = ScalingConfig(min_warm=1, max=2, target_concurrency=4, idle_timeout_s=600, stable_window_s=1)
    async with pool_rig(tmp_path, tiny_model_dir, scaling=scaling, max_instance_age_s=MAX_AGE_S) as rig:
        rig.demand.now.in_flight, rig.demand.now.last_arrival = 8, 0.0  # a burst: two instances
        await settled(rig, 0.0, 2)
        rig.demand.now.in_flight = 0
        await rig.tick(5.0)  # idle: min_warm keeps one READY, the other is put to sleep
        await eventually(lambda: rig.pool.counts()["SLEEPING"] == 1 and len(rig.pool.endpoints()) == 1)
        [old] = rig.pool.endpoints()

        await rig.tick(MAX_AGE_S + 1)  # due: the sleeper is woken to take its place
        await eventually(lambda: len(rig.pool.endpoints()) == 2)
        assert [action for action, _ in rig.backend.calls] == ["sleep", "wake"]
        await settled(rig, MAX_AGE_S + 2, 1)  # then the old one is drained
        assert old.id not in {i.id for i in rig.pool.endpoints()}
        assert rig.sample("stoker_instance_recycles_total", outcome="replaced") == 1
        assert rig.sample("stoker_instance_starts_total", outcome="ready") == 2  # no start for it

        # The woken one is as old as the one it replaced: its own turn comes next, with a start.
        [woken] = rig.pool.endpoints()
        await rig.tick(MAX_AGE_S + 3)
        await eventually(lambda: len(rig.pool.endpoints()) == 2)  # a fresh start: no sleeper is left
        await settled(rig, MAX_AGE_S + 4, 1)
        assert woken.id not in {i.id for i in rig.pool.endpoints()}
        assert rig.sample("stoker_instance_recycles_total", outcome="replaced") == 2
        assert rig.sample("stoker_instance_starts_total", outcome="ready") == 3
