"""A base's pool and its adapters' own forecast, on the real pool and policy on a fake clock
(`tests.warm_pool.rig`): the adapter arrivals the platform names to the pool reach the predictive
policy, which starts the base at zero ahead of an adapter's expected request and hands the adapter
to `on_adapters` once an instance is READY to load it on; each load times the adapter tier."""

from __future__ import annotations

from pathlib import Path

from tests.activator.conftest import eventually
from tests.warm_pool.rig import pool_rig
from warm_pool.policies.base import ScalingConfig

PERIOD_S = 600.0  # a job's period: gaps of 600 s, bin 60 of 10 s; window (588, 622.2) s


async def test_the_base_starts_ahead_of_an_adapter_s_expected_request_and_hands_it_to_load(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    scaling = ScalingConfig(max=1, idle_timeout_s=120.0, stable_window_s=10.0)
    async with pool_rig(tmp_path, tiny_model_dir, scaling=scaling) as rig:
        handed: list[tuple[float, tuple[str, ...]]] = []
        rig.pool.on_adapters = lambda names: handed.append((rig.clock[0], names))
        for k in range(7):  # six gaps: its window is representative after the fifth
            t = k * PERIOD_S
            rig.clock[0] = t
            rig.pool.adapter_arrived("qa")
            await rig.serve_one(t)
            rig.pool.adapter_loaded(0.02)
            await rig.tick(t + 200.0)  # idle past the timeout: stopped
            await eventually(lambda: not rig.pool.endpoints() and rig.pool.counts()["SLEEPING"] == 0)
        last = 6 * PERIOD_S
        await rig.tick(last + 570.0)
        assert rig.pool.last_decision.ready == 0 and not handed  # not yet: the window opens at ~586 s
        await rig.tick(last + 590.0)
        assert rig.pool.last_decision.ready == 1 and "adapter qa" in rig.pool.last_decision.reason
        await eventually(lambda: bool(rig.pool.endpoints()))  # started for it, with no request held
        await rig.tick(last + 591.0)
        assert handed == [(last + 591.0, ("qa",))]  # once READY: to be loaded on it
        await rig.tick(last + 592.0)
        assert len(handed) == 1  # once a gap
        assert rig.pool._tracker.startup.adapter == 0.02  # the adapter tier, from the loads
