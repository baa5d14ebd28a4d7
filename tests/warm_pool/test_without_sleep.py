"""An engine without sleep mode (vLLM's CPU build): no policy asks it to sleep, its idle instances
stop instead, and predictive's lead is the measured start from the tier the snapshot is in. Tables
and scripts on a logical clock, through the tracker and the shared rules as the pool runs them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.warm_pool.policy_script import obs
from warm_pool.policies import POLICIES, make_policy
from warm_pool.policies.base import Decision, Observation, ScalingConfig, Tier, TierTimes
from warm_pool.policies.predictive import PredictiveConfig, PredictiveState, predictive
from warm_pool.policies.rules import RuledState, with_rules
from warm_pool.policies.settings import bind_policy
from warm_pool.profiles import InstanceModel
from warm_pool.simulate import simulate
from warm_pool.trace import TraceRequest
from warm_pool.tracker import ObservationTracker

STARTUP = TierTimes(wake=1.0, page_cache=20.0, disk=28.0, object_storage=60.0)


# ---- the shared rules --------------------------------------------------------------------------------


def scripted(*answers: tuple[int, int]):
    def policy(observation, state, now):
        ready, sleeping = answers[state]
        return Decision(ready, sleeping, reason="scripted"), state + 1

    return policy


def run(answers, steps, *, can_sleep: bool, max_: int = 4):
    policy = with_rules(scripted(*answers), ScalingConfig(max=max_))
    state, out = RuledState(inner=0), []
    for now in steps:
        d, state = policy(Observation(0, 0, 0, 0, None, can_sleep=can_sleep), state, now)
        out.append((d.ready, d.sleeping))
    return out


def test_the_rules_ask_no_sleep_of_an_engine_without_sleep_mode_and_stop_after_the_long_delay():
    answers = [(4, 0), (1, 3), (1, 3), (1, 3), (1, 3)]
    steps = [0.0, 10.0, 29.9, 30.0, 32.0]
    # with sleep: out of READY after the short delay (10 s), into SLEEPING
    assert run(answers, steps, can_sleep=True) == [(4, 0), (2, 2), (1, 3), (1, 3), (1, 3)]
    # without: the same steps down, after the long delay (30 s), and nothing asleep: stopped
    assert run(answers, steps, can_sleep=False) == [(4, 0), (4, 0), (4, 0), (2, 0), (1, 0)]


# ---- every policy reaches zero ---------------------------------------------------------------------


def idle_after_one_request(name: str, *, can_sleep: bool, end: int = 700) -> list[tuple[int, int, int]]:
    """One request in flight 0-10 s, then silence; the policy bound as the pool binds it, the
    instances doing at once what it asks. Returns (t, ready, sleeping) each second."""
    bound = bind_policy(name, ScalingConfig(max=2, idle_timeout_s=300, stable_window_s=60))
    tracker, state = ObservationTracker(STARTUP), bound.initial_state
    ready = sleeping = 0
    out = []
    tracker.arrived(0.0)
    for t in range(end):
        if t == 10:
            tracker.finished(10.0, 10.0)
        o = tracker.observe(
            float(t),
            in_flight=1 if t < 10 else 0,
            queued=0,
            ready=ready,
            starting=0,
            sleeping=sleeping,
            can_sleep=can_sleep,
        )
        d, state = bound.decide(o, state, float(t))
        ready, sleeping = d.ready, d.sleeping
        out.append((t, ready, sleeping))
    return out


@pytest.mark.parametrize(
    ("name", "can_sleep", "out_of_ready_at", "zero_at"),
    [
        # not representative yet: READY for the stable window (60 s), then asleep until the idle
        # timeout (300 s) ...
        ("predictive", True, 70, 310),
        # ... or, without sleep mode, stopped then: the same 60 s, not the 300 s a sleep would have held
        ("predictive", False, 70, 70),
        ("kpa", False, 70, 70),  # a stable window (60 s) without traffic
        ("keepalive", False, 310, 310),  # keep-alive = idle timeout, from the last busy second
        ("histogram", False, 310, 310),  # its fallback keep-alive
        ("reactive", False, 309, 309),  # idle timeout after the last second with work
    ],
)
def test_every_policy_takes_an_idle_deployment_to_zero(name, can_sleep, out_of_ready_at, zero_at):
    out = idle_after_one_request(name, can_sleep=can_sleep)
    assert next(t for t, r, _ in out if t > 10 and r == 0) == out_of_ready_at
    assert next(t for t, r, s in out if t > 10 and r == s == 0) == zero_at
    assert all(r == s == 0 for t, r, s in out if t >= zero_at)
    if not can_sleep:
        assert all(s == 0 for _, _, s in out)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_policy_asks_for_sleep_without_sleep_mode_even_after_a_burst(name):
    bound = make_policy(name, ScalingConfig(max=8, target_concurrency=1))
    state = bound.initial_state
    for t in range(0, 400):
        busy = 6 if t < 20 else 0
        o = obs(
            in_flight=busy, ready=min(busy, 8), last_arrival=min(t, 19.0), idle_since=None if busy else 20.0
        )
        d, state = bound.decide(replace(o, can_sleep=False), state, float(t))
        assert d.sleeping == 0


# ---- predictive: stop or READY, the lead a start --------------------------------------------------------

C = PredictiveConfig(target_concurrency=4, max=16)


def learned(gaps: tuple[float, ...]) -> PredictiveState:
    _, state = predictive(obs(idle_gaps=gaps, ready=1), PredictiveState(), 0.0, C)
    return state


def at(state: PredictiveState, idle_for: float, **kw) -> tuple[int, int]:
    o = replace(obs(idle_since=1000.0, last_arrival=999.0, startup=STARTUP, **kw), can_sleep=False)
    d, _ = predictive(o, state, 1000.0 + idle_for, C)
    return d.ready, d.sleeping


def test_gaps_of_100s_stop_the_last_instance_and_start_one_a_disk_start_before_the_next_arrival():
    # prewarm 0.9 × 100 = 90 s into the gap; a disk start takes 28 s: started at 62 s, READY by 90 s.
    # The stop lasts 62 s, more than one start (28 s): worth it. With sleep it would wake at 87 s.
    state = learned((100.0, 101.0, 102.0) * 3 + (101.5,))
    assert at(state, 0, ready=1) == (0, 0)  # stopped at once, not asleep
    assert at(state, 61.9) == (0, 0)
    assert at(state, 62.0) == (1, 0)
    assert at(state, 112.0, ready=1) == (1, 0)  # kept until the tail's bin end × 1.1 = 112.2 s
    assert at(state, 113.5, ready=1) == (0, 0)  # the arrival did not come: stopped
    assert at(state, 1800.0) == (0, 0)
    # snapshot in the page cache (20 s, measured): started later, at 70 s
    assert at(state, 69.9, start_tier="page_cache") == (0, 0)
    assert at(state, 70.0, start_tier="page_cache") == (1, 0)
    # a sleeping count from a caller that got it wrong changes nothing: no wake to plan on
    assert at(state, 62.0, sleeping=1) == (1, 0)


def test_gaps_shorter_than_two_starts_keep_the_last_instance_ready():
    # prewarm 0.9 × 40 = 36 s, less a 28 s start: a stop of 8 s, shorter than a start: a flap. READY
    # until the tail's bin end × 1.1 = 43 × 1.1 = 47.3 s.
    state = learned((40.0, 41.0, 42.0) * 3 + (41.5,))
    assert at(state, 0, ready=1) == (1, 0)
    assert at(state, 47.0, ready=1) == (1, 0)
    assert at(state, 47.5, ready=1) == (0, 0)
    # none up (it failed, say): nothing lost by waiting, started at 36 − 28 = 8 s
    assert at(state, 7.9) == (0, 0)
    assert at(state, 8.0) == (1, 0)


def test_irregular_sparse_gaps_stop_the_last_instance_for_the_whole_gap_and_keep_it_stopped():
    # gaps of 30, 60, …, 300 s: READY from 0 to 298 s would cost ~183 s per arrival it catches, more
    # than kpa's one stable window (60 s): stopped, and the next arrival starts one
    state = learned(tuple(30.0 * n for n in range(1, 11)))
    assert at(state, 0, ready=1) == (0, 0)
    assert at(state, 1) == (0, 0)  # with none up, the answer is the same: no stop-start flap
    assert at(state, 150) == (0, 0)


def test_stopped_between_arrivals_it_asks_for_the_page_cache_and_the_forecast_looks_a_start_ahead():
    state = learned((100.0, 101.0, 102.0) * 3 + (101.5,))
    o = replace(obs(idle_since=0.0, last_arrival=0.0, startup=STARTUP, snapshot_id="s"), can_sleep=False)
    d, _ = predictive(o, state, 30.0, C)
    assert (d.ready, d.sleeping, d.warm) == (0, 0, ("s",))  # the fastest tier without sleep
    d, _ = predictive(replace(o, start_tier=Tier.PAGE_CACHE), state, 30.0, C)
    assert d.warm == ()  # already there
    d, _ = predictive(replace(o, idle_since=None, last_arrival=None), state, 1800.0, C)
    assert d.warm == ()  # stopped for good: nothing to warm


# ---- the tracker ------------------------------------------------------------------------------------


def test_the_tracker_never_offers_a_wake_without_sleep_mode_and_passes_the_engine_figures_on():
    tracker = ObservationTracker(STARTUP)
    o = tracker.observe(0.0, in_flight=0, queued=0, ready=0, starting=0, sleeping=1, cached_tier="page_cache")
    assert (o.start_tier, o.can_sleep) == (Tier.WAKE, True)
    o = tracker.observe(
        1.0,
        in_flight=0,
        queued=0,
        ready=2,
        starting=0,
        sleeping=1,
        cached_tier="page_cache",
        can_sleep=False,
        engine_waiting=3,
        kv_cache_usage=0.5,
    )
    assert (o.start_tier, o.can_sleep, o.engine_waiting, o.kv_cache_usage) == (Tier.PAGE_CACHE, False, 3, 0.5)
    o = tracker.observe(2.0, in_flight=0, queued=0, ready=0, starting=0)
    assert (o.can_sleep, o.engine_waiting, o.kv_cache_usage) == (True, 0, None)  # the defaults


# ---- the simulator ---------------------------------------------------------------------------------


def test_the_simulator_never_sleeps_an_instance_that_cannot_and_its_observations_say_so():
    # a request every 200 s: with sleep, the last instance sleeps between them and wakes for the next
    model = InstanceModel(
        startup=TierTimes(wake=1.0, page_cache=5.0, disk=10.0, object_storage=20.0),
        prefill_tps=100.0,
        decode_tps=10.0,
        concurrency=1,
        jitter=0.0,
    )
    trace = tuple(TraceRequest(200.0 * n, 100, 10) for n in range(8))
    scaling = ScalingConfig(max=1, target_concurrency=1, idle_timeout_s=600, stable_window_s=60)
    asleep = simulate(trace, bind_policy("predictive", scaling), scaling=scaling, model=model)
    assert asleep.wakes > 0 and asleep.sleep_seconds > 0
    awake = simulate(
        trace, bind_policy("predictive", scaling), scaling=scaling, model=replace(model, can_sleep=False)
    )
    assert (awake.served, awake.wakes, awake.sleep_seconds) == (8, 0, 0.0)
    # Stopped after each request, started for the next: the first six find nothing up (the idle-gap
    # histogram needs five gaps); the last two find one started a page-cache start (5 s, measured)
    # ahead of the learned gap, 0.9 × 188 s − 5 s = 164 s into it.
    assert (awake.starts, awake.cold_starts, awake.cold_from_wake) == (8, 6, 0)
