"""predictive sizes from service time (time on an instance), not from time held: a burst at zero,
held for the start it asked for, is not a trend (issue 13, item 6).

A script on a logical clock: the same `ObservationTracker` the pool and the simulator feed, told of
each arrival, each call and each finish as the live loop would be, and the policy held to the shared
rules, as `make_policy` builds it for the pool."""

from __future__ import annotations

import math

import pytest

from tests.warm_pool.policy_script import obs, second
from warm_pool.policies import make_policy
from warm_pool.policies.base import ScalingConfig, TierTimes
from warm_pool.policies.predictive import PredictiveConfig, PredictiveState, predictive
from warm_pool.tracker import ObservationTracker

BURST = 8
SCALING = ScalingConfig(max=2, target_concurrency=8)  # 5.6 concurrent per instance at 70 %


def burst_at_zero(arrive_at: float, start_s: float, service_s: float, until: float = 40.0):
    """Eight requests arrive together at `arrive_at` with nothing READY; the start the first call
    asks for is READY `start_s` later, and each request then holds a slot for `service_s`. The loop
    is poked at the arrival and ticks every whole second. Returns (now, ready asked for) per call."""
    bound = make_policy("predictive", SCALING)
    state = bound.initial_state
    tracker = ObservationTracker(
        TierTimes(wake=1.0, page_cache=start_s, disk=start_s, object_storage=start_s)
    )
    ready_at, done_at = arrive_at + start_s, arrive_at + start_s + service_s
    instances = 0
    out = []
    calls = sorted({arrive_at, *(float(t) for t in range(math.ceil(until)))})
    for now in calls:
        if now == arrive_at:
            for _ in range(BURST):
                tracker.arrived(now)
        if now >= done_at and tracker.outstanding:
            for _ in range(BURST):
                tracker.finished(done_at, service_s)
        held = BURST if arrive_at <= now < ready_at else 0
        in_flight = BURST if ready_at <= now < done_at else 0
        up = instances if now >= ready_at else 0
        o = tracker.observe(
            now, in_flight=in_flight, queued=held, ready=up, starting=instances - up, cached_tier="disk"
        )
        d, state = bound.decide(o, state, now)
        instances = max(instances, d.ready)  # what the pool would have asked for by now
        out.append((now, d.ready))
    return out


@pytest.mark.parametrize(
    ("arrive_at", "start_s", "service_s"),
    [
        (0.0, 8.0, 2.0),  # on a tick
        (0.61, 8.0, 2.0),  # between ticks, as in the log
        (0.61, 28.0, 2.0),  # a disk start (the GPU prior): held for 28 ticks
        (0.3, 8.0, 0.39),  # short requests
        (0.3, 5.0, 4.0),  # long ones: 8 × 4 s of service arrive in one second
    ],
)
def test_a_burst_held_for_a_start_asks_for_one_instance_throughout_the_hold_and_after(
    arrive_at, start_s, service_s
):
    decisions = burst_at_zero(arrive_at, start_s, service_s)
    served_until = arrive_at + start_s + service_s
    during = [(now, ready) for now, ready in decisions if arrive_at <= now <= served_until]
    assert during and all(ready == 1 for _, ready in during), during
    assert max(ready for _, ready in decisions) == 1, decisions  # before, during and after


def test_time_held_is_taken_out_of_the_window_but_time_on_an_instance_stays():
    # 2 requests/s, each 2 s on an instance, and 4 held throughout: L = 4 + 4 = 8 concurrent, of
    # which 4 are held; W = L / λ would say 4 s, service time is (8 − 4) / 2 = 2 s.
    c = PredictiveConfig(target_concurrency=4, max=16)
    _, state = predictive(obs(ready=1, in_flight=4, queued=4), PredictiveState(), 0.0, c)
    for t in range(1, 61):
        o = obs(seconds=(second(t - 1, 8.0, arrivals=2),), ready=1, in_flight=4, queued=4, latency_s=2.0)
        d, state = predictive(o, state, float(t), c)
    assert "× 2.00s" in d.reason
    # nothing held: the whole window's concurrency is service, as before
    state = PredictiveState()
    for t in range(1, 61):
        o = obs(seconds=(second(t - 1, 8.0, arrivals=2),), ready=3, in_flight=8, latency_s=2.0)
        d, state = predictive(o, state, float(t), c)
    assert "× 4.00s" in d.reason


def test_the_held_seconds_kept_stay_within_the_window():
    c = PredictiveConfig(target_concurrency=4, max=16)
    state = PredictiveState()
    for t in range(0, 500):
        o = obs(seconds=(second(t - 1, 8.0, arrivals=1),), queued=8, starting=1, last_arrival=0.0)
        _, state = predictive(o, state, t + 0.5, c)
    assert len(state.held) <= c.stable_window_s + 1
    # a clock that steps back counts nothing twice
    _, again = predictive(obs(queued=8), state, 10.0, c)
    assert again.held == state.held
