"""The reactive policy, as scripts of observations on a fake clock and tables of configs."""

from __future__ import annotations

import functools
import math
import random

import pytest

from warm_pool.errors import InvalidConfig, InvalidScalingConfig, PoolError
from warm_pool.policies.base import Decision, Observation, Policy, ScalingConfig
from warm_pool.policies.reactive import PolicyState, reactive


def obs(in_flight=0, queued=0, ready=0, starting=0, last_arrival=None) -> Observation:
    return Observation(in_flight, queued, ready, starting, last_arrival)


def play(config: ScalingConfig, script) -> list[Decision]:
    """Feed (now, observation, expected desired) steps to the policy in order; check each."""
    state, decisions = PolicyState.initial(), []
    for now, o, expected in script:
        decision, state = reactive(o, state, now, config)
        assert decision.desired == expected, f"t={now}: {o} → {decision}"
        decisions.append(decision)
    return decisions


def test_burst_from_zero_asks_for_one_at_once():
    d = play(ScalingConfig(max=1), [(0.0, obs(queued=20, last_arrival=0.0), 1)])
    assert d[0].reason == "capped at max 1: 20 requests want 5"
    d = play(ScalingConfig(max=3), [(0.0, obs(queued=1, last_arrival=0.0), 1)])
    assert d[0].reason == "cold start: 1 queued, nothing ready or starting"


def test_a_burst_within_max_asks_for_all_it_needs_at_once():
    play(ScalingConfig(max=10, target_concurrency=4), [(0.0, obs(queued=20, last_arrival=0.0), 5)])


def test_rising_load_scales_up_on_the_call_it_is_seen():
    play(
        ScalingConfig(max=5, target_concurrency=4),
        [
            (0.0, obs(in_flight=4, ready=1, last_arrival=0.0), 1),
            (0.1, obs(in_flight=5, ready=1, last_arrival=0.1), 2),
            (0.2, obs(in_flight=8, queued=8, ready=2, last_arrival=0.2), 4),
            (0.3, obs(in_flight=8, queued=40, ready=4, last_arrival=0.3), 5),  # max
        ],
    )


def test_load_that_drops_is_held_for_the_stable_window_then_let_go():
    d = play(
        ScalingConfig(max=5, target_concurrency=4, stable_window_s=60),
        [
            (0.0, obs(in_flight=12, ready=3, last_arrival=0.0), 3),
            (10.0, obs(in_flight=4, ready=3, last_arrival=10.0), 3),
            (30.0, obs(in_flight=4, ready=3, last_arrival=30.0), 3),
            (59.9, obs(in_flight=4, ready=3, last_arrival=59.9), 3),
            (60.0, obs(in_flight=4, ready=3, last_arrival=60.0), 1),  # the t=0 peak left the window
        ],
    )
    assert d[1].reason == "holding 3: highest in the last 60s (now 1)"
    assert d[-1].reason == "load: ceil(4/4) = 1"


def test_a_second_peak_restarts_the_window():
    play(
        ScalingConfig(max=5, target_concurrency=1, stable_window_s=10),
        [
            (0.0, obs(in_flight=3, ready=3, last_arrival=0.0), 3),
            (5.0, obs(in_flight=1, ready=3, last_arrival=5.0), 3),
            (8.0, obs(in_flight=2, ready=3, last_arrival=8.0), 3),
            (10.0, obs(in_flight=1, ready=3, last_arrival=10.0), 2),  # t=0 gone; t=8's 2 remains
            (17.9, obs(in_flight=1, ready=2, last_arrival=17.9), 2),
            (18.0, obs(in_flight=1, ready=2, last_arrival=18.0), 1),
        ],
    )


def test_idle_goes_to_zero_only_after_the_idle_timeout():
    d = play(
        ScalingConfig(max=2, idle_timeout_s=300, stable_window_s=60),
        [
            (0.0, obs(queued=1, last_arrival=0.0), 1),
            (2.0, obs(queued=1, starting=1, last_arrival=0.0), 1),
            (5.0, obs(in_flight=1, ready=1, last_arrival=0.0), 1),
            (10.0, obs(ready=1, last_arrival=0.0), 1),
            (100.0, obs(ready=1, last_arrival=0.0), 1),  # the window is long past: held by idleness
            (304.9, obs(ready=1, last_arrival=0.0), 1),
            (305.0, obs(ready=1, last_arrival=0.0), 0),  # 300 s after the last request in flight
            (306.0, obs(last_arrival=0.0), 0),
        ],
    )
    assert d[4].reason == "holding 1 until idle for 300s (idle 95.0s)"
    assert d[6].reason == "idle for 300s: to zero"


def test_an_arrival_between_ticks_restarts_the_idle_clock():
    play(
        ScalingConfig(idle_timeout_s=30, stable_window_s=5),
        [
            (0.0, obs(in_flight=1, ready=1, last_arrival=0.0), 1),
            (20.0, obs(ready=1, last_arrival=15.0), 1),  # came and went unseen, but it was recorded
            (44.9, obs(ready=1, last_arrival=15.0), 1),
            (45.0, obs(ready=1, last_arrival=15.0), 0),
        ],
    )


def test_a_short_idle_timeout_wins_over_a_long_window():
    play(
        ScalingConfig(max=3, target_concurrency=1, idle_timeout_s=2, stable_window_s=60),
        [
            (0.0, obs(in_flight=3, ready=3, last_arrival=0.0), 3),
            (1.0, obs(ready=3, last_arrival=0.0), 3),
            (1.9, obs(ready=3, last_arrival=0.0), 3),
            (2.0, obs(ready=3, last_arrival=0.0), 0),
            (2.5, obs(in_flight=1, ready=0, last_arrival=2.5), 1),  # and the next request starts afresh
        ],
    )


def test_an_instance_being_replaced_is_still_wanted_while_not_idle():
    # The only instance failed and is gone: nothing ready or starting, but it was wanted a moment ago.
    play(
        ScalingConfig(idle_timeout_s=60),
        [(0.0, obs(in_flight=1, ready=1, last_arrival=0.0), 1), (1.0, obs(last_arrival=0.0), 1)],
    )


def test_nothing_wanted_and_nothing_there_stays_at_zero():
    play(ScalingConfig(), [(0.0, obs(), 0), (1000.0, obs(), 0)])


def test_min_warm_is_kept_through_idleness_and_max_caps_the_load():
    play(
        ScalingConfig(min_warm=2, max=4, target_concurrency=4, idle_timeout_s=10, stable_window_s=5),
        [
            (0.0, obs(), 2),
            (1.0, obs(in_flight=100, ready=2, last_arrival=1.0), 4),
            (2.0, obs(ready=4, last_arrival=1.0), 4),
            (7.0, obs(ready=4, last_arrival=1.0), 2),
            (1000.0, obs(ready=2, last_arrival=1.0), 2),
        ],
    )


def test_history_stays_bounded_however_often_it_is_called():
    config = ScalingConfig(max=6, target_concurrency=1, stable_window_s=60)
    rng = random.Random(7)
    state = PolicyState.initial()
    for step in range(20_000):  # 20 calls a second for 1000 s, load jumping about
        now = step * 0.05
        _, state = reactive(obs(in_flight=rng.randint(0, 8), ready=6, last_arrival=now), state, now, config)
        assert len(state.history) <= config.max + 1
        assert all(now - t < 60 for t, _ in state.history)


def test_same_inputs_same_answer():
    config, o = ScalingConfig(max=4), obs(in_flight=5, ready=1, last_arrival=3.0)
    _, state = reactive(obs(in_flight=9, ready=1, last_arrival=1.0), PolicyState.initial(), 1.0, config)
    assert reactive(o, state, 4.0, config) == reactive(o, state, 4.0, config)


def test_a_policy_is_the_function_with_its_config_bound():
    policy: Policy = functools.partial(reactive, config=ScalingConfig(max=2))
    decision, state = policy(obs(queued=3, last_arrival=0.0), PolicyState.initial(), 0.0)
    assert decision.desired == 1 and state.last_desired == 1


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"max": 0}, "max", "max must be at least 1, got 0"),
        ({"min_warm": 2, "max": 1}, "min_warm", "min_warm must be in 0..max (0..1), got 2"),
        ({"min_warm": -1}, "min_warm", "min_warm must be in 0..max (0..1), got -1"),
        ({"target_concurrency": 0}, "target_concurrency", "target_concurrency must be at least 1, got 0"),
        ({"idle_timeout_s": 0}, "idle_timeout_s", "idle_timeout_s must be a finite number > 0, got 0"),
        (
            {"stable_window_s": -5.0},
            "stable_window_s",
            "stable_window_s must be a finite number > 0, got -5.0",
        ),
        (
            {"idle_timeout_s": math.inf},
            "idle_timeout_s",
            "idle_timeout_s must be a finite number > 0, got inf",
        ),
        ({"max": 2.5}, "max", "max must be an integer, got 2.5"),
        ({"min_warm": True}, "min_warm", "min_warm must be an integer, got True"),
        (
            {"stable_window_s": "60"},
            "stable_window_s",
            "stable_window_s must be a number of seconds, got '60'",
        ),
    ],
)
def test_bad_configs_name_the_field_the_value_and_the_range(kwargs, field, message):
    with pytest.raises(InvalidScalingConfig) as err:
        ScalingConfig(**kwargs)
    assert (err.value.field, str(err.value)) == (field, message)
    assert isinstance(err.value, InvalidConfig) and isinstance(err.value, PoolError)
    assert isinstance(err.value, ValueError)


def test_defaults_are_valid_and_frozen():
    c = ScalingConfig()
    assert (c.min_warm, c.max, c.target_concurrency, c.idle_timeout_s, c.stable_window_s) == (
        0,
        1,
        4,
        300,
        60,
    )
    with pytest.raises(AttributeError):
        c.max = 3  # type: ignore[misc]
