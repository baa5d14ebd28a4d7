"""The pool's sleeping tier, step by step on a fake clock (`tests.warm_pool.rig`): a sleep or a
wake made to fail, and an engine made to die, on cue."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.activator.conftest import eventually
from tests.warm_pool.rig import Rig, asleep, pool_rig
from warm_pool.policies.base import ScalingConfig


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path):
    scaling = ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1)
    async with pool_rig(tmp_path, tiny_model_dir, scaling=scaling) as r:
        yield r


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
