"""A start whose snapshot fails its check: FAILED with the reason, and no start after it until the
deployment is deployed again; the activator is told, so held requests are refused with the reason.
The real `Pool` and store on a fake clock, with the in-memory backend of `test_pool_sleep`."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore, import_hf_dir
from tests.activator.conftest import eventually
from tests.warm_pool.rig import Load
from warm_pool.backends.memory import MemoryBackend
from warm_pool.errors import SnapshotCorrupt
from warm_pool.metrics import PoolMetrics
from warm_pool.policies.base import ScalingConfig
from warm_pool.pool import Pool, PoolSpec
from warm_pool.snapshot import SnapshotSource


@dataclass
class Demand:
    now: Load = field(default_factory=lambda: Load(queued=1))  # one request held throughout
    unavailable: list[str | None] = field(default_factory=list)

    def load(self) -> Load:
        return self.now

    def capacity_changed(self) -> None:
        pass

    def set_unavailable(self, reason: str | None) -> None:
        self.unavailable.append(reason)


@pytest.fixture
def corrupt(tmp_path: Path, tiny_model_dir: Path) -> SnapshotSource:
    store = SnapshotStore(tmp_path / "store")
    snapshot_id = import_hf_dir(tiny_model_dir, store).id
    weights = store.path_of(snapshot_id) / "model.safetensors"
    weights.chmod(0o644)
    os.truncate(weights, 100)
    return SnapshotSource(store, snapshot_id)


async def test_acquire_refuses_a_corrupt_snapshot_and_lets_its_pin_go(corrupt: SnapshotSource) -> None:
    with pytest.raises(SnapshotCorrupt, match=r"is corrupt: model\.safetensors: size 100 bytes"):
        await corrupt.acquire("d-1")
    assert not corrupt.store.is_pinned(corrupt.snapshot_id)


async def test_a_corrupt_snapshot_stops_the_starts_until_a_redeploy(tmp_path: Path, corrupt) -> None:
    registry, clock = CollectorRegistry(), [0.0]
    backend, demand = MemoryBackend(), Demand()
    scaling = ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1)
    pool = Pool(
        PoolSpec("d", corrupt, scaling=scaling, grace_period_s=5),
        backend,
        PoolMetrics(registry),
        engines=backend,
        clock=lambda: clock[0],
        tick_s=3600,
    )
    pool.attach(demand)
    loop = asyncio.create_task(pool.run())

    def failed_starts() -> float:
        return (
            registry.get_sample_value(
                "stoker_instance_starts_total", {"deployment": "d", "outcome": "failed"}
            )
            or 0.0
        )

    async def tick(at: float) -> None:
        clock[0] = at
        before = pool.last_decision
        pool.poke()
        await eventually(lambda: pool.last_decision is not before)

    try:
        pool.request_arrived()
        await tick(0.0)
        await eventually(lambda: failed_starts() == 1 and not any(pool.counts().values()))
        [reason] = demand.unavailable
        assert reason.startswith("deployment 'd': snapshot ") and "is corrupt" in reason
        for at in (10.0, 100.0, 1000.0):  # far past any restart backoff
            await tick(at)
            await asyncio.sleep(0.01)
            assert pool.last_decision.ready == 1 and failed_starts() == 1
        assert backend.alive == set()  # no engine process was ever started

        pool.reconfigure(scaling, pool.policy)  # deployed again: one more try, which fails the same way
        await eventually(lambda: failed_starts() == 2)
        assert demand.unavailable[1] is None and demand.unavailable[2] == reason
    finally:
        await pool.close(drain=False)
        await loop
