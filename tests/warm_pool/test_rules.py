"""The shared rules around any policy: reactive floor, cold-start fast path, bounds, flap suppression."""

from __future__ import annotations

import pytest

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import Decision, Observation, ScalingConfig
from warm_pool.policies.rules import RuledState, RulesConfig, with_rules


def scripted(*answers: tuple[int, int]):
    """A stand-in policy that answers (ready, sleeping) from a list, one per call."""

    def policy(observation, state, now):
        ready, sleeping = answers[state]
        return Decision(ready, sleeping, reason="scripted"), state + 1

    return policy


def obs(in_flight=0, queued=0, ready=0, starting=0, waking=0) -> Observation:
    return Observation(in_flight, queued, ready, starting, None, waking=waking)


def run(scaling, answers, steps, rules=None):
    """steps: (now, observation); returns the (ready, sleeping) answered at each step."""
    policy = with_rules(scripted(*answers), scaling, rules)
    state, out = RuledState(inner=0), []
    for now, o in steps:
        d, state = policy(o, state, now)
        out.append((d.ready, d.sleeping))
    return out


def test_a_request_queued_at_zero_gets_an_instance_at_once_whatever_the_policy_says():
    policy = with_rules(scripted((0, 0)), ScalingConfig(max=4))
    d, _ = policy(obs(queued=1), RuledState(inner=0), 0.0)
    assert d.ready == 1 and d.reason == "cold start: 1 queued, nothing ready, starting or waking"


def test_the_reactive_floor_answers_what_has_arrived():
    out = run(
        ScalingConfig(max=10, target_concurrency=4), [(1, 0)], [(0.0, obs(in_flight=8, queued=9, ready=1))]
    )
    assert out == [(5, 0)]  # ceil(17 / 4)


@pytest.mark.parametrize(
    ("scaling", "answer", "expected"),
    [
        (ScalingConfig(min_warm=2, max=5), (0, 0), (2, 0)),  # min_warm holds READY up
        (ScalingConfig(max=3), (7, 2), (3, 0)),  # max caps READY, and sleeping gives way
        (ScalingConfig(max=5), (3, 4), (3, 2)),  # ready + sleeping ≤ max
        (ScalingConfig(max=5), (-2, -1), (0, 0)),  # nonsense from a policy is clamped
    ],
)
def test_bounds(scaling, answer, expected):
    assert run(scaling, [answer], [(0.0, obs())]) == [expected]


def test_no_scale_down_within_the_delay_of_a_scale_up_and_then_at_most_halving_per_step():
    answers = [(8, 0)] + [(1, 0)] * 10
    steps = [
        (0.0, obs()),
        (10.0, obs()),
        (29.9, obs()),
        (30.0, obs()),
        (31.0, obs()),
        (32.0, obs()),
        (34.0, obs()),
        (36.0, obs()),
    ]
    assert [r for r, _ in run(ScalingConfig(max=8), answers, steps)] == [8, 8, 8, 4, 4, 2, 1, 1]


def test_going_to_sleep_waits_only_the_short_delay():
    answers = [(4, 0), (1, 3), (1, 3), (1, 3)]
    steps = [(0.0, obs()), (9.9, obs()), (10.0, obs()), (12.0, obs())]
    assert run(ScalingConfig(max=4), answers, steps) == [(4, 0), (4, 0), (2, 2), (1, 3)]
    # the same step down, stopping instead: the long delay
    answers = [(4, 0), (1, 0), (1, 0)]
    steps = [(0.0, obs()), (10.0, obs()), (30.0, obs())]
    assert run(ScalingConfig(max=4), answers, steps) == [(4, 0), (4, 0), (2, 0)]


def test_a_start_requests_wait_on_or_were_refused_for_is_kept():
    scaling = ScalingConfig(max=4)
    policy = with_rules(scripted(*[(0, 0)] * 5), scaling, RulesConfig(keep_starts_s=600))
    state = RuledState(inner=0)
    refused = Observation(0, 0, 0, 1, None, refused_at=100.0)  # one starting, its request refused
    for now, kept in ((101.0, 1), (700.0, 1), (700.5, 0)):  # kept for keep_starts_s after the refusal
        d, state = policy(refused, RuledState(inner=state.inner), now)
        assert d.ready == kept, now
    d, _ = policy(Observation(0, 2, 1, 2, None), RuledState(inner=0), 0.0)  # two held: both starts kept
    assert d.ready == 3 and "keeping 2 start(s)" in d.reason
    d, _ = policy(Observation(0, 0, 0, 1, None), RuledState(inner=0), 0.0)  # nobody waits: let go
    assert d.ready == 0


def test_scale_up_is_never_delayed():
    answers = [(4, 0), (1, 0), (6, 0)]
    steps = [(0.0, obs()), (1.0, obs()), (1.5, obs())]
    assert [r for r, _ in run(ScalingConfig(max=8), answers, steps)] == [4, 4, 6]


def test_bad_rules_are_refused_with_the_value():
    with pytest.raises(InvalidConfig, match="down_delay_s must be a finite number ≥ 0, got -1"):
        RulesConfig(down_delay_s=-1)
    with pytest.raises(InvalidConfig, match=r"max_down_rate must be ≥ 1, got 0\.5"):
        RulesConfig(max_down_rate=0.5)
