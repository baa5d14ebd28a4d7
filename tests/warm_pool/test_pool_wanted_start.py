"""A start that requests wait on, or were refused for, is not cancelled for idleness (the shared
rules' rule 3, `warm_pool.policies.rules`), and the pool tells the activator how long such a start is expected to take
(`Pool.expected_start_s`). On the pool's rig: the real pool and policy, a fake clock, and a start
held open until the test lets it finish."""

from __future__ import annotations

import asyncio

from tests.activator.conftest import eventually
from tests.warm_pool.rig import pool_rig
from warm_pool.backends.memory import MemoryBackend
from warm_pool.policies.base import ScalingConfig
from warm_pool.policies.settings import startup_priors


class SlowStarts(MemoryBackend):
    """Engines that become ready only when the test sets `done`."""

    def __init__(self) -> None:
        super().__init__()
        self.done = asyncio.Event()

    async def wait_ready(self, handle, timeout_s: float, *, health_path: str) -> str:
        await self.done.wait()
        return await super().wait_ready(handle, timeout_s, health_path=health_path)


async def test_a_start_a_request_was_refused_for_outlives_the_idle_timeout(tmp_path, tiny_model_dir):
    backend = SlowStarts()
    scaling = ScalingConfig(idle_timeout_s=60, stable_window_s=10)
    async with pool_rig(tmp_path, tiny_model_dir, backend, policy="reactive", scaling=scaling) as rig:
        assert rig.pool.expected_start_s() is None  # nothing observed yet
        rig.pool.request_arrived()
        rig.demand.now.queued = 1
        await rig.tick(1.0)
        await eventually(lambda: rig.pool.counts()["STARTING"] == 1)
        expected = rig.pool.expected_start_s()  # the engine's prior, until a start is measured
        assert expected == startup_priors("cpu").of(rig.pool._start_tier) and expected > 0
        # The held request reaches its deadline and is refused; the start goes on.
        rig.demand.now.queued = 0
        rig.clock[0] = 121.0
        rig.pool.request_finished(None, None)
        # Past the idle timeout: the reactive policy asks for none. The start is kept: the client's
        # retry will find it (before: cancelled, and the retry started again from nothing).
        await rig.tick(200.0)
        decision = rig.pool.last_decision
        assert decision.ready == 1 and "keeping 1 start(s) requests wait on" in decision.reason
        assert rig.pool.counts()["STARTING"] == 1 and len(backend.alive) == 1
        backend.done.set()
        await eventually(lambda: rig.pool.counts()["READY"] == 1)
        # READY and idle, it goes as any idle instance does.
        await rig.tick(900.0)
        await eventually(lambda: rig.pool.counts()["READY"] == 0)


async def test_a_start_nobody_waits_on_is_cancelled_as_before(tmp_path, tiny_model_dir):
    backend = SlowStarts()
    scaling = ScalingConfig(idle_timeout_s=60, stable_window_s=10)
    async with pool_rig(tmp_path, tiny_model_dir, backend, policy="reactive", scaling=scaling) as rig:
        rig.pool.request_arrived()
        rig.demand.now.queued = 1
        await rig.tick(1.0)
        await eventually(lambda: rig.pool.counts()["STARTING"] == 1)
        rig.demand.now.queued = 0
        rig.clock[0] = 2.0
        rig.pool.request_finished(1.0, None)  # served elsewhere (a hedge): nobody is refused
        await rig.tick(200.0)
        await eventually(lambda: rig.pool.counts()["STARTING"] == 0)
        backend.done.set()
