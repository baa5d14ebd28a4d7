"""The shared bookkeeping behind every observation: events in, one `Observation` out."""

from __future__ import annotations

import pytest

from warm_pool.policies.base import SecondSample, Tier, TierTimes
from warm_pool.tracker import ObservationTracker


def observe(tracker: ObservationTracker, now: float, **kw):
    kw = {"in_flight": 0, "queued": 0, "ready": 0, "starting": 0, **kw}
    return tracker.observe(now, **kw)


def test_whole_seconds_count_arrivals_and_time_weighted_concurrency():
    tr = ObservationTracker()
    observe(tr, 10.0)
    tr.arrived(10.25)  # outstanding 1 from 10.25
    tr.arrived(10.5)  # 2 from 10.5
    tr.finished(11.5, 1.25)  # 1 from 11.5
    o = observe(tr, 12.2)
    # [10, 11): 0.25 s at 1 + 0.5 s at 2 = 1.25; [11, 12): 0.5 s at 2 + 0.5 s at 1 = 1.5
    assert o.seconds == (SecondSample(10.0, 2, 1.25), SecondSample(11.0, 0, 1.5))
    assert o.arrivals == 2 and o.last_arrival == 10.5
    o = observe(tr, 13.0)  # what was reported is not reported again; [12, 13) had 1 throughout
    assert o.seconds == (SecondSample(12.0, 0, 1.0),) and o.arrivals == 0


def test_idle_gaps_run_from_out_of_work_to_the_next_arrival():
    tr = ObservationTracker()
    tr.arrived(0.0)
    tr.arrived(0.5)
    tr.finished(2.0, 2.0)
    assert observe(tr, 2.5).idle_since is None  # one still outstanding
    tr.finished(3.0, 2.5)
    o = observe(tr, 4.0)
    assert o.idle_since == 3.0 and o.idle_gaps == ()
    tr.arrived(33.0)  # 30 s idle
    tr.finished(34.0, None)  # rejected: out of work again at 34
    tr.arrived(40.0)
    o = observe(tr, 41.0)
    assert o.idle_gaps == (30.0, 6.0) and o.idle_since is None
    assert observe(tr, 42.0).idle_gaps == ()


def test_latency_is_a_running_mean_then_a_slow_average_of_served_requests_only():
    tr = ObservationTracker()
    assert observe(tr, 0.0).latency_s is None
    for s in (1.0, 2.0, 3.0):
        tr.arrived(0.0)
        tr.finished(1.0, s)
    tr.arrived(1.0)
    tr.finished(1.0, None)  # a rejection teaches nothing about latency
    assert observe(tr, 1.0).latency_s == pytest.approx(2.0)
    for _ in range(1000):  # the workload changes: within a few hundred requests it is learned
        tr.arrived(2.0)
        tr.finished(2.0, 10.0)
    assert observe(tr, 2.0).latency_s == pytest.approx(10.0, rel=0.01)


def test_startup_times_start_from_priors_and_follow_measured_starts():
    tr = ObservationTracker(TierTimes(wake=1.0, page_cache=20.0, disk=28.0, object_storage=60.0))
    tr.started(Tier.DISK, 8.0)  # the first measurement replaces the prior
    tr.started("wake", 0.5)
    tr.started("disk", float("nan"))  # ignored
    o = observe(tr, 0.0)
    assert (o.startup.disk, o.startup.wake, o.startup.page_cache) == (8.0, 0.5, 20.0)
    tr.started(Tier.DISK, 10.0)  # the second one counts half
    assert observe(tr, 0.0).startup.disk == pytest.approx(9.0)


def test_the_start_tier_is_a_wake_while_an_instance_sleeps():
    tr = ObservationTracker()
    assert observe(tr, 0.0, cached_tier="page_cache").start_tier is Tier.PAGE_CACHE
    assert observe(tr, 0.0, sleeping=1, cached_tier="disk").start_tier is Tier.WAKE
    assert observe(tr, 0.0).start_tier is Tier.DISK


def test_buffers_stay_bounded_through_a_long_silence():
    tr = ObservationTracker(max_pending_seconds=100)
    tr.arrived(0.0)
    o = observe(tr, 1_000_000.0)  # nobody observed for 11 days: only the newest 100 seconds are kept
    assert len(o.seconds) == 100
    assert o.seconds[-1] == SecondSample(999_999.0, 0, 1.0)
