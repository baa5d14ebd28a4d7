"""Each LoRA adapter's own forecast on its base (`warm_pool.policies.adapter_forecast`, the predictive
policy's step 7): the module docstring's worked example, bursts, the bound, and the decisions the
predictive policy makes from it: the base READY for an adapter's expected request, and the adapter
named to be loaded ahead, only while its window is open."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from tests.warm_pool.policy_script import obs
from warm_pool.errors import InvalidConfig
from warm_pool.policies.adapter_forecast import AdapterForecastConfig, add_arrivals, due
from warm_pool.policies.base import TierTimes
from warm_pool.policies.predictive import PredictiveConfig, PredictiveState, predictive
from warm_pool.tracker import ObservationTracker

CONFIG = AdapterForecastConfig()
STARTUP = TierTimes(wake=1.0, page_cache=20.0, disk=28.0, object_storage=60.0, adapter=0.25)


def periodic(name: str, period: float, jitter: float, times: int, seed: int = 1, burst_s: float = 2.0):
    """A job's bursts: (name, first, last) every `period` ± `jitter` seconds."""
    rnd, t, out = random.Random(seed), 0.0, []
    for _ in range(times):
        t += period + rnd.uniform(-jitter, jitter)
        out.append((name, t, t + burst_s))
    return out


def learned(arrivals, config=CONFIG):
    tracks = ()
    for item in arrivals:
        tracks = add_arrivals(tracks, (item,), config)
    return tracks


def test_the_worked_example_every_600_s_is_worth_a_base_every_3000_s_is_not():
    ((name, qa),) = learned(periodic("qa", 600.0, 20.0, 12))
    assert name == "qa" and qa.gaps.total == 11
    assert qa.window == pytest.approx((558.6, 632.4))
    assert qa.per_hit == pytest.approx(39.1, abs=0.1)
    ((_, rare),) = learned(periodic("qa", 3000.0, 10.0, 12))
    assert rare.window == pytest.approx((2920.4, 3070.2))
    assert rare.per_hit == pytest.approx(77.3, abs=0.1) and rare.per_hit > PredictiveConfig().stable_window_s


def test_gaps_inside_a_burst_are_not_counted_and_a_new_adapter_waits_for_its_gaps():
    tracks = learned([("a", 0.0, 0.0), ("a", 3.0, 3.0), ("a", 9.0, 9.5)])  # all within burst_s
    assert tracks[0][1].gaps.total == 0 and tracks[0][1].last == 9.5
    tracks = learned(periodic("b", 120.0, 0.0, 4))  # 3 gaps: not representative yet
    assert tracks[0][1].window is None and due(tracks, 1000.0, 1e9) == ()


def test_at_most_max_tracked_adapters_the_one_heard_from_longest_ago_forgotten():
    config = AdapterForecastConfig(max_tracked=3)
    tracks = learned([(f"a{i}", float(i), float(i)) for i in range(5)], config)
    assert [n for n, _ in tracks] == ["a2", "a3", "a4"]
    tracks = add_arrivals(tracks, (("a2", 10.0, 10.0),), config)  # heard from again: the newest
    assert [n for n, _ in tracks] == ["a3", "a4", "a2"]


@pytest.mark.parametrize(
    ("field", "value"), [("burst_s", -1.0), ("margin_s", math.inf), ("max_tracked", 0), ("max_tracked", True)]
)
def test_a_bad_setting_is_refused_naming_it(field, value):
    with pytest.raises(InvalidConfig, match=field):
        AdapterForecastConfig(**{field: value})


def _state_after(arrivals) -> PredictiveState:
    """The predictive state that heard of `arrivals`, through observations as the tracker builds them."""
    state = PredictiveState()
    for item in arrivals:
        o = replace(obs(startup=STARTUP), adapter_arrivals=(item,))
        _, state = predictive(o, state, item[2], PredictiveConfig())
    return state


def _idle(state: PredictiveState, now: float, last: float, **kw):
    """The base idle since `last` (its own histogram not representative), asleep unless told."""
    o = obs(
        startup=STARTUP,
        last_arrival=last,
        idle_since=last,
        sleeping=kw.pop("sleeping", 1),
        start_tier=kw.pop("start_tier", "wake"),
        **kw,
    )
    return predictive(o, state, now, PredictiveConfig())[0]


def test_the_base_is_ready_for_an_adapter_s_expected_request_and_only_then():
    arrivals = [("qa", 600.0 * k, 600.0 * k + 2.0) for k in range(1, 8)]  # gaps of 598 s: bin 59
    state = _state_after(arrivals)
    ((_, qa),) = state.adapters
    assert qa.window == pytest.approx((578.2, 612.0))
    last = arrivals[-1][2]
    lead = STARTUP.adapter + CONFIG.margin_s + STARTUP.wake  # asleep: a wake, a load, the margin
    opens = last + 578.2 - lead
    before = _idle(state, opens - 1.0, last)
    assert (before.ready, before.adapters) == (0, ())
    at = _idle(state, opens + 0.5, last)
    assert at.ready == 1 and "adapter qa" in at.reason
    assert at.adapters == ()  # nothing READY to load it on yet: at the first call with one
    assert _idle(state, last + 611.0, last).ready == 1
    after = _idle(state, last + 612.5, last)
    assert (after.ready, after.adapters) == (0, ())
    # Stopped (no instance at all): the lead is a start from disk, so it opens earlier.
    cold = _idle(state, last + 578.2 - (STARTUP.disk + 2.25) + 0.5, last, sleeping=0, start_tier="disk")
    assert cold.ready == 1 and "adapter qa" in cold.reason


def test_an_adapter_too_spread_to_hold_a_base_for_is_neither_pre_warmed_nor_loaded_ahead():
    state = _state_after(periodic("rare", 3000.0, 10.0, 12))
    ((_, rare),) = state.adapters
    last = rare.last
    asleep = _idle(state, last + rare.window[0] + 1.0, last)
    assert (asleep.ready, asleep.adapters) == (0, ())  # 77 s of READY per hit: over the budget
    up = _idle(state, last + rare.window[0] + 1.0, last, ready=1, sleeping=0, start_tier="page_cache")
    assert up.adapters == ()  # a load ahead would evict an adapter from a busy base's instance


def test_the_adapters_due_are_named_soonest_expected_first():
    a = [("late", 600.0 * k + 5.0, 600.0 * k + 7.0) for k in range(1, 8)]
    b = [("early", 600.0 * k, 600.0 * k + 2.0) for k in range(1, 8)]
    state = _state_after(sorted(a + b, key=lambda item: item[2]))
    assert [n for n, _ in state.adapters] == ["early", "late"]
    now = 4790.0  # early: open from 4777.95 to 4814, late from 4782.95 to 4819
    up = _idle(state, now, 4207.0, ready=1, sleeping=0, start_tier="page_cache")
    assert up.adapters == ("early", "late")
    state = replace(state, adapters=state.adapters[::-1])  # the order tracked does not matter
    assert _idle(state, now, 4207.0, ready=1, sleeping=0, start_tier="page_cache").adapters == (
        "early",
        "late",
    )


def test_the_tracker_names_each_adapter_once_per_observation_and_learns_the_adapter_tier():
    tracker = ObservationTracker(STARTUP, max_pending_adapters=2)
    for t, name in [(1.0, "a"), (1.5, "b"), (2.0, "a"), (2.5, "c")]:
        tracker.arrived(t)
        tracker.adapter_arrived(t, name)
    o = tracker.observe(3.0, in_flight=0, queued=0, ready=1, starting=0)
    assert o.adapter_arrivals == (("a", 1.0, 2.0), ("b", 1.5, 1.5)) and tracker.dropped_adapters == 1
    assert o.arrivals == 4  # named, not counted again
    assert tracker.observe(4.0, in_flight=0, queued=0, ready=1, starting=0).adapter_arrivals == ()
    for seconds in (0.05, 0.05, 0.05):
        tracker.adapter_loaded(seconds)
    tracker.adapter_loaded(math.nan)  # not a measurement
    assert tracker.startup.adapter == pytest.approx(0.05)
    for at in (10.0, 40.0, 75.0):
        tracker.adapter_loaded(0.05, at)
    assert (
        tracker.observe(80.0, in_flight=0, queued=0, ready=1, starting=0).adapter_loads == 2
    )  # the last 60 s


def test_an_adapter_is_named_to_be_loaded_ahead_once_a_gap_and_only_with_an_instance_ready():
    arrivals = [("qa", 600.0 * k, 600.0 * k + 2.0) for k in range(1, 8)]
    state, last = _state_after(arrivals), arrivals[-1][2]
    now = last + 578.2

    def call(state, now, **kw):
        o = obs(startup=STARTUP, last_arrival=last, idle_since=last, start_tier="page_cache", **kw)
        return predictive(o, state, now, PredictiveConfig())

    starting, state = call(state, now, starting=1)  # the base coming up for it: nothing to load on
    assert starting.ready == 1 and starting.adapters == ()
    first, state = call(state, now + 1.0, ready=1)
    again, state = call(state, now + 2.0, ready=1)
    assert (first.adapters, again.adapters) == (("qa",), ())
    assert again.ready == 1  # still READY for it: only the load ahead is once
    # Its request came (a new gap begins): named again in the next window.
    o = replace(obs(startup=STARTUP, ready=1), adapter_arrivals=(("qa", last + 600.0, last + 601.0),))
    _, state = predictive(o, state, last + 601.0, PredictiveConfig())
    later, _ = call(state, last + 601.0 + 578.2, ready=1)
    assert later.adapters == ("qa",)


def test_nothing_is_loaded_ahead_while_the_instances_lrus_turn_over():
    arrivals = [("qa", 600.0 * k, 600.0 * k + 2.0) for k in range(1, 8)]
    state, last = _state_after(arrivals), arrivals[-1][2]
    busy = _idle(state, last + 580.0, last, ready=2, sleeping=0, start_tier="page_cache")
    assert busy.adapters == ("qa",)
    o = replace(
        obs(startup=STARTUP, ready=2, last_arrival=last, idle_since=last, start_tier="page_cache"),
        adapter_loads=3,  # in the last minute, on 2 instances: more than one each
    )
    churning, _ = predictive(o, state, last + 580.0, PredictiveConfig())
    assert churning.adapters == () and churning.ready >= 1
