"""The fleet simulator (`warm_pool.fleet_sim`) on small synthetic traces: who is awake where, what
waits, and that no device's memory is ever exceeded."""

from __future__ import annotations

import pytest

from warm_pool.fleet_sim import GB, FleetDeployment, FleetSimulation, rotate
from warm_pool.policies.base import ScalingConfig
from warm_pool.policies.settings import bind_policy
from warm_pool.profiles import GPU
from warm_pool.simulate import simulate
from warm_pool.trace import TraceRequest


def bursts(starts: list[float], n: int = 5, gap: float = 0.5) -> tuple[TraceRequest, ...]:
    """`n` short requests (~1 s each on the GPU model) every `gap` s from each start."""
    return tuple(TraceRequest(s + k * gap, 200, 40) for s in starts for k in range(n))


def taking_turns(spacing: float, rounds: int = 4, names: str = "abc") -> list[tuple[str, list[float]]]:
    """Each deployment bursts in turn, `spacing` s after the previous one's burst."""
    return [
        (name, [100 + (j + len(names) * r) * spacing for r in range(rounds)]) for j, name in enumerate(names)
    ]


def fleet(turns, *, gb: float = 20, **kw) -> FleetSimulation:
    deps = [
        FleetDeployment(name, bursts(starts), int(gb * GB), policy=kw.pop("policy", "predictive"))
        for name, starts in turns
    ]
    return FleetSimulation(deps, record=True, **kw)


def assert_memory_kept(f: FleetSimulation) -> None:
    assert f.timeline, "nothing recorded"
    for t, used, _ in f.timeline:
        assert all(n <= f.memory for n in used.values()), (t, used)
    assert all(n <= f.memory for n in f.peak_used.values()), f.peak_used


# (spacing between bursts of consecutive deployments, whether the arbiter must put one to sleep for another)
TURNS = {
    "far apart: each policy puts its own instance to sleep before the next burst": (100.0, False),
    "close together: the arbiter puts the idle one to sleep for the held requests": (15.0, True),
}


@pytest.mark.parametrize(("spacing", "forced"), TURNS.values(), ids=TURNS.keys())
def test_three_deployments_take_turns_on_a_device_that_fits_one_awake(spacing, forced):
    f = fleet(taking_turns(spacing), devices=1, device_memory=30 * GB)  # 20 GB awake: one at a time
    report = f.run()
    assert_memory_kept(f)
    assert report.requests == 60 and report.rejected == 0
    # Never two awake at once, and the device is the only one in use.
    assert max(sum(1 for n in awake.values() if n) for _, _, awake in f.timeline) == 1
    assert report.peak_devices == 1
    for d in report.deployments:
        # One fresh start each (its first burst waits for it); every later burst is a wake.
        assert d.starts == 1, d
        assert d.slow_cold_starts == 5, d
        assert d.wakes >= 3, d
    assert (sum(d.evicted for d in report.deployments) > 0) == forced
    assert report.wakes == sum(d.wakes for d in report.deployments)
    if not forced:  # first bursts overlap when close: one waits for another's start to finish
        assert report.p99_wait_s <= GPU.startup.disk + GPU.startup.wake + 1


def test_memory_is_never_exceeded_with_mixed_sizes_on_two_devices():
    # A 50 GB and two 30 GB deployments, on two 64 GB devices: never all three awake at once.
    turns = taking_turns(7.0, rounds=6)
    deps = [
        FleetDeployment(name, bursts(starts, n=12, gap=0.3), int(gb * GB))
        for (name, starts), gb in zip(turns, (50, 30, 30), strict=True)
    ]
    f = FleetSimulation(deps, devices=2, device_memory=64 * GB, record=True)
    report = f.run()
    assert_memory_kept(f)
    assert report.requests == 3 * 6 * 12
    assert report.rejected == 0
    assert report.peak_devices <= 2


def test_a_dedicated_baseline_has_no_wakes_and_nothing_forced_by_others():
    f = fleet(taking_turns(15.0), devices=1, device_memory=30 * GB, mode="dedicated", policy="kpa")
    report = f.run()
    assert_memory_kept(f)
    assert report.devices == 3
    assert report.wakes == 0
    assert all(d.evicted == 0 and d.wakes == 0 for d in report.deployments)
    # Each burst after a quiet spell longer than kpa's stable window is a fresh start.
    assert report.slow_cold_starts >= 3 * 5


def test_one_deployment_alone_on_its_device_runs_as_the_single_simulator_does():
    trace = bursts([10, 200, 260, 900], n=8)
    scaling = ScalingConfig(max=4, target_concurrency=GPU.concurrency)
    alone = simulate(trace, bind_policy("predictive", scaling), scaling=scaling, model=GPU, seed=3)
    dep = FleetDeployment("a", trace, 20 * GB)
    report = FleetSimulation([dep], devices=1, device_memory=80 * GB, seed=3).run()  # room for 4
    (d,) = report.deployments
    assert (d.requests, d.rejected, d.wakes, d.starts) == (
        alone.requests,
        alone.rejected,
        alone.wakes,
        alone.starts,
    )
    assert d.slow_cold_starts == alone.cold_starts - alone.cold_from_wake
    assert d.p99_wait_s == alone.p99_wait_s
    assert d.device_seconds == pytest.approx(alone.gpu_seconds + alone.starting_seconds)


def test_a_busy_neighbour_is_never_evicted_the_held_requests_wait_for_it():
    # b's only burst comes while a serves long requests (until ~58 s): b cannot take the device
    # until a is idle, and then needs a fresh start of its own.
    long_a = tuple(TraceRequest(10 + k, 200, 800) for k in range(3))  # READY at 38 s, then 20 s each
    deps = [FleetDeployment("a", long_a, 20 * GB), FleetDeployment("b", bursts([20]), 20 * GB)]
    f = FleetSimulation(deps, devices=1, device_memory=30 * GB, record=True)
    report = f.run()
    assert_memory_kept(f)
    a, b = report.deployments
    assert report.rejected == 0
    assert a.slow_cold_starts == 3 and b.slow_cold_starts == 5
    assert max(sum(1 for n in awake.values() if n) for _, _, awake in f.timeline) == 1
    # a's requests (to ~57 s), then b's own start (its snapshot warmed meanwhile: page cache).
    assert b.p99_wait_s >= 57 - 22 + GPU.startup.page_cache


def test_a_start_puts_an_idle_neighbour_to_sleep_rather_than_stop_a_sleeper():
    # Two 80 GB devices. gpu0: y (40 GB, serving one 500 s request) and s (40 GB, asleep after its
    # one early request: 0.75 GB). gpu1: x (24 GB, serving 500 s) and c (40 GB, a request every
    # 10 s, idle between). n's first request at 100 s needs 40 GB: on gpu0 only by stopping s's
    # sleeper (s is worth least), on gpu1 by putting c to sleep. The arbiter stops the fewest
    # sleepers first: c sleeps (its next request a wake), s's second request (300 s) is a wake too.
    # Before, the least worth lost decided: s was stopped and its second request waited for a
    # fresh start (8 slow cold starts in all, 2 of them s's).
    def long(t: float) -> tuple[TraceRequest, ...]:
        return (TraceRequest(t, 200, 40 * 500),)

    deps = [
        FleetDeployment("y", long(0.0), 40 * GB),
        FleetDeployment("x", long(0.1), 24 * GB),
        FleetDeployment("c", tuple(TraceRequest(0.2 + 10 * k, 200, 40) for k in range(40)), 40 * GB),
        FleetDeployment("s", (TraceRequest(0.3, 200, 40), TraceRequest(300.0, 200, 40)), 40 * GB),
        FleetDeployment("n", (TraceRequest(100.0, 200, 40),), 40 * GB),
    ]
    f = FleetSimulation(deps, devices=2, device_memory=80 * GB, record=True)
    report = f.run()
    assert_memory_kept(f)
    by = {d.name: d for d in report.deployments}
    assert (by["s"].slow_cold_starts, by["s"].wakes) == (1, 1)  # its first request only; then a wake
    assert by["c"].evicted == 1 and by["c"].wakes == 1  # put to sleep for n, woken for its next
    assert report.slow_cold_starts == 7 and report.rejected == 0


ROTATIONS = {
    "no shift": (0.0, [0.0, 1.0, 2.5]),
    "one second": (1.0, [1.0, 2.0, 0.5]),
    "past the end comes round": (2.0, [2.0, 0.0, 1.5]),
    "a negative shift rotates back": (-1.0, [2.0, 0.0, 1.5]),
}


@pytest.mark.parametrize(("shift", "times"), ROTATIONS.values(), ids=ROTATIONS.keys())
def test_rotate(shift, times):
    trace = tuple(TraceRequest(t, i, i) for i, t in enumerate([0.0, 1.0, 2.5]))  # period 3 s
    moved = rotate(trace, shift)
    assert [r.t for r in moved] == sorted(times)
    assert sorted(r.context_tokens for r in moved) == [0, 1, 2]
