"""predictive: the forecast at the start-up horizon, Little's law, and the idle-gap histogram deciding
when the last instance is READY, asleep or gone; with the shared rules where the pool would use it."""

from __future__ import annotations

import math
import random

import pytest

from tests.warm_pool.policy_script import obs, second
from warm_pool.policies import make_policy
from warm_pool.policies.base import ScalingConfig, TierTimes
from warm_pool.policies.predictive import PredictiveConfig, PredictiveState, predictive
from warm_pool.policies.rules import RuledState

C = PredictiveConfig(target_concurrency=4, max=16)  # 2.8 per instance at 70 %
STARTUP = TierTimes(wake=1.0, page_cache=20.0, disk=28.0, object_storage=60.0)


def run_seconds(state, start, end, rate, config=C, latency=2.0, **kw):
    """One call per whole second, `rate(t)` arrivals in second t - 1, each held `latency` seconds
    (the second's concurrency, by Little's law); returns the decisions."""
    out = []
    for t in range(start, end):
        n = rate(t - 1)
        o = obs(seconds=(second(t - 1, n * latency, arrivals=n),), startup=STARTUP, **kw)
        d, state = predictive(o, state, float(t), config)
        out.append(d)
    return out, state


def test_a_burst_from_zero_gets_what_it_needs_at_once_through_the_rules():
    bound = make_policy("predictive", ScalingConfig(max=16, target_concurrency=4))
    d, _ = bound.decide(obs(queued=30, last_arrival=0.0), bound.initial_state, 0.0)
    assert d.ready == 8  # ceil(30 / 4): the reactive floor, in the very first call
    bound = make_policy("predictive", ScalingConfig(max=3, target_concurrency=4))
    d, _ = bound.decide(obs(queued=30, last_arrival=0.0), bound.initial_state, 0.0)
    assert (d.ready, d.sleeping) == (3, 0)  # max


def test_a_rising_rate_is_provisioned_ahead_at_the_start_up_horizon():
    ramp = lambda t: round(t / 30)  # noqa: E731  0 → 20 requests/s over 10 minutes
    decisions, state = run_seconds(PredictiveState(), 1, 601, ramp, ready=8, latency_s=2.0, in_flight=1)
    level = state.forecast.holt.level
    d = decisions[-1]
    assert d.forecast > level  # a disk start away (28 s), the rate is higher than now
    assert d.ready == math.ceil(d.forecast * 2.0 / 2.8)  # Little's law: rate × latency / per instance
    # with an instance asleep the next one is a wake away (1 s): a nearer horizon, a smaller lead
    o = obs(sleeping=1, start_tier="wake", startup=STARTUP, latency_s=2.0, in_flight=1)
    d_wake, _ = predictive(o, state, 601.0, C)
    assert level <= d_wake.forecast < d.forecast


def test_a_regular_idle_gap_sleeps_then_wakes_the_last_instance_before_the_next_arrival():
    # ten gaps of 100-102 s: the next arrival is expected from 0.9 × 100 = 90 s into the gap
    _, state = predictive(
        obs(idle_gaps=(100.0, 101.0, 102.0) * 3 + (101.5,), ready=1), PredictiveState(), 0.0, C
    )

    def at(idle_for: float, **kw):
        o = obs(idle_since=1000.0, last_arrival=999.0, startup=STARTUP, **kw)
        d, _ = predictive(o, state, 1000.0 + idle_for, C)
        return d.ready, d.sleeping

    assert at(0, ready=1) == (0, 1)  # asleep at once: GPU freed, weights kept in host RAM
    assert at(86.9, sleeping=1) == (0, 1)
    assert at(87.0, sleeping=1) == (1, 0)  # woken 90 − 1 (wake) − 2 (margin) = 87 s into the gap
    assert at(112.0, ready=1) == (1, 0)  # kept READY until the 90th percentile's bin end × 1.1
    assert at(113.5, ready=1) == (0, 1)  # the arrival did not come: asleep again
    assert at(1800.0, sleeping=1) == (0, 0)  # idle for half an hour: stopped
    # with no instance left, the lead is a fresh start from disk: up 90 − 28 = 62 s into the gap
    assert at(61.9) == (0, 1) and at(62.0) == (1, 0)


def test_before_the_histogram_is_representative_it_keeps_half_a_minute_then_sleeps():
    # one long gap seen: no reason to hold READY for 1.1 × 300 s; a wake is a second away
    o = obs(ready=1, idle_since=0.0, last_arrival=0.0, idle_gaps=(300.0,))
    d, state = predictive(o, PredictiveState(), 29.0, C)
    assert (d.ready, d.sleeping) == (1, 0) and "not representative" in d.reason
    d, _ = predictive(obs(ready=1, idle_since=0.0, last_arrival=0.0), state, 30.0, C)
    assert (d.ready, d.sleeping) == (0, 1)


def test_irregular_sparse_gaps_sleep_through_instead_of_holding_a_wide_window_ready():
    # gaps spread over 20-290 s: READY from the head to the tail would cost ~100 s per gap that
    # ends inside it, more than a stable window (60 s); the last instance sleeps the whole gap
    gaps = (22.0, 60.0, 83.0, 99.0, 108.0, 177.0, 206.0, 214.0, 233.0, 249.0, 289.0)
    _, state = predictive(obs(idle_gaps=gaps, ready=1), PredictiveState(), 0.0, C)
    for idle_for in (0.0, 20.0, 50.0, 150.0):
        d, _ = predictive(obs(ready=1, idle_since=1000.0, last_arrival=999.0), state, 1000.0 + idle_for, C)
        assert (d.ready, d.sleeping) == (0, 1), d.reason
    # with no instance at all, a pre-warm is a start (20-60 s) saved, not a wake: it is still made
    d, _ = predictive(obs(idle_since=1000.0, last_arrival=999.0, startup=STARTUP), state, 1050.0, C)
    assert d.ready == 1


def test_the_latency_comes_from_the_window_not_from_the_first_requests_to_finish():
    # A backlog drains: 2 requests/s arrive and each spends 6 s held or in flight (12 concurrent),
    # but the short ones finished first, so the tracker's learned latency says 2 s.
    state = PredictiveState()
    for t in range(1, 61):
        o = obs(seconds=(second(t - 1, 12.0, arrivals=2),), ready=2, in_flight=12, latency_s=2.0)
        d, state = predictive(o, state, float(t), C)
    assert "× 6.00s" in d.reason
    assert d.ready == math.ceil(d.forecast * 6.0 / 2.8)  # W = L / λ = 12 / 2 = 6 s
    # a window without arrivals falls back to the learned latency
    o = obs(ready=1, in_flight=1, latency_s=2.0, seconds=(second(200.0, 0.0),))
    d, _ = predictive(o, state, 201.0 + C.stable_window_s, C)
    assert "× 2.00s" in d.reason


def test_the_instances_a_burst_needed_are_kept_asleep_for_the_next_one():
    state = PredictiveState()
    _, state = predictive(obs(ready=6, in_flight=20, last_arrival=0.0, latency_s=1.0), state, 0.0, C)
    d, state = predictive(obs(ready=6, idle_since=5.0, last_arrival=4.0, latency_s=1.0), state, 6.0, C)
    assert (d.ready, d.sleeping) == (1, 5)  # one READY (not representative yet), five asleep
    d, _ = predictive(obs(ready=0, sleeping=6, idle_since=5.0, last_arrival=4.0), state, 1806.0, C)
    assert (d.ready, d.sleeping) == (0, 0)  # half an hour later they go


def test_it_asks_for_the_snapshot_in_the_page_cache_only_when_a_start_would_read_disk():
    active = dict(ready=1, in_flight=1, last_arrival=0.0, snapshot_id="abc")
    assert predictive(obs(start_tier="disk", **active), PredictiveState(), 0.0, C)[0].warm == ("abc",)
    assert predictive(obs(start_tier="page_cache", **active), PredictiveState(), 0.0, C)[0].warm == ()
    assert predictive(obs(start_tier="wake", sleeping=1, **active), PredictiveState(), 0.0, C)[0].warm == ()


def test_state_stays_bounded_and_the_same_inputs_give_the_same_answer():
    rng = random.Random(3)
    state = PredictiveState()
    for t in range(1, 5000):
        busy = rng.random() < 0.3
        o = obs(
            seconds=(second(t - 1, 3.0 if busy else 0.0, arrivals=rng.randint(0, 9) if busy else 0),),
            ready=rng.randint(0, 16),
            in_flight=3 if busy else 0,
            idle_since=None if busy else t - 1.0,
            last_arrival=t - 1.0,
            idle_gaps=(rng.uniform(0, 900),) if rng.random() < 0.1 else (),
        )
        _d, state = predictive(o, state, float(t), C)
        assert len(state.readies) <= C.max + 1
        assert len(state.histogram.counts) in (0, 600)
    assert predictive(o, state, 5000.0, C) == predictive(o, state, 5000.0, C)


@pytest.mark.parametrize("name", ["predictive", "kpa", "keepalive", "histogram", "reactive"])
def test_every_policy_keeps_min_warm_and_stays_within_max(name):
    bound = make_policy(name, ScalingConfig(min_warm=2, max=3, target_concurrency=4))
    state: RuledState = bound.initial_state
    for now, o in [(0.0, obs()), (1.0, obs(queued=100, ready=2, last_arrival=1.0)), (2.0, obs(ready=3))]:
        d, state = bound.decide(o, state, now)
        assert 2 <= d.ready <= 3 and d.ready + d.sleeping <= 3
