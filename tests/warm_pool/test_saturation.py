"""The shared rules' saturation rule: engines that report requests waiting inside them, or a full KV
cache, get one more READY instance, within the bounds and the flap rules. Tables on a logical clock."""

from __future__ import annotations

import pytest

from warm_pool.errors import InvalidConfig
from warm_pool.policies import make_policy
from warm_pool.policies.base import Decision, Observation, ScalingConfig
from warm_pool.policies.rules import RuledState, RulesConfig, with_rules


def answering(ready: int):
    def policy(observation, state, now):
        return Decision(ready, reason="policy"), state

    return policy


def obs(ready=0, starting=0, waiting=0, kv=None, in_flight=0) -> Observation:
    return Observation(in_flight, 0, ready, starting, None, engine_waiting=waiting, kv_cache_usage=kv)


@pytest.mark.parametrize(
    ("observation", "answer", "max_", "expected", "why"),
    [
        (obs(ready=2), 2, 4, 2, "policy"),  # no figures, nothing to say
        (obs(ready=2, waiting=1), 2, 4, 3, "saturated: 1 waiting inside the engines: 2 READY + 1"),
        (obs(ready=2, kv=0.9), 2, 4, 3, "saturated: KV cache 90% full: 2 READY + 1"),  # at the threshold
        (obs(ready=2, kv=0.89), 2, 4, 2, "policy"),
        (obs(ready=2, waiting=0, kv=None), 2, 4, 2, "policy"),  # the CPU engine: no KV figure
        (obs(ready=4, waiting=3, kv=0.95), 4, 4, 4, "capped at max 4: saturated"),
        (obs(ready=2, waiting=1), 5, 8, 5, "policy"),  # the policy already asks for more
        (obs(ready=0, starting=1, waiting=2), 1, 4, 1, "policy"),  # nothing READY reports: silent
        # one already starting covers the +1: the pool counts it (2 + 1 = 3), starts nothing more
        (obs(ready=2, starting=1, waiting=1), 2, 4, 3, "saturated"),
        (obs(ready=2, waiting=1), 1, 4, 3, "saturated"),  # a policy answering less is overruled
    ],
)
def test_saturated_engines_get_one_more_ready_instance(observation, answer, max_, expected, why):
    policy = with_rules(answering(answer), ScalingConfig(max=max_))
    d, _ = policy(observation, RuledState(inner=None), 0.0)
    assert d.ready == expected
    assert d.reason.startswith(why)


def test_the_thresholds_are_configurable():
    policy = with_rules(answering(2), ScalingConfig(max=4), RulesConfig(saturation_waiting=4))
    assert policy(obs(ready=2, waiting=3), RuledState(inner=None), 0.0)[0].ready == 2
    assert policy(obs(ready=2, waiting=4), RuledState(inner=None), 0.0)[0].ready == 3
    policy = with_rules(answering(2), ScalingConfig(max=4), RulesConfig(saturation_kv_usage=1.0))
    assert policy(obs(ready=2, kv=0.99), RuledState(inner=None), 0.0)[0].ready == 2
    assert policy(obs(ready=2, kv=1.0), RuledState(inner=None), 0.0)[0].ready == 3


def test_a_saturated_fleet_grows_one_instance_per_start_and_shrinks_only_after_the_down_delay():
    # the policy would keep 1; the engines stay full while the pool grows, then empty at t=60
    policy = with_rules(answering(1), ScalingConfig(max=3))
    script = [
        (0.0, obs(ready=1, waiting=2), 2),
        (5.0, obs(ready=1, starting=1, waiting=2), 2),  # the start is under way: no third
        (20.0, obs(ready=2, kv=0.93), 3),  # READY, still full: one more
        (40.0, obs(ready=3, kv=0.95), 3),  # at max
        (45.0, obs(ready=3, kv=0.4), 3),  # fine now, but 25 s after the last step up: held (30 s)
        (50.0, obs(ready=3, kv=0.3), 1),  # 30 s after: the step down, halving at most (3 → 1)
    ]
    state = RuledState(inner=None)
    for now, o, expected in script:
        d, state = policy(o, state, now)
        assert d.ready == expected, (now, d)


@pytest.mark.parametrize("name", ["predictive", "kpa", "keepalive", "histogram", "reactive"])
def test_every_policy_is_held_to_it(name):
    bound = make_policy(name, ScalingConfig(max=4, target_concurrency=4))
    o = Observation(1, 0, 1, 0, 0.0, engine_waiting=2, kv_cache_usage=0.97)  # one request: one instance
    d, _ = bound.decide(o, bound.initial_state, 1.0)
    assert d.ready == 2 and "saturated" in d.reason


def test_bad_thresholds_are_refused_with_the_value():
    with pytest.raises(InvalidConfig, match=r"saturation_kv_usage must be in \(0, 1\], got 1.5"):
        RulesConfig(saturation_kv_usage=1.5)
    with pytest.raises(InvalidConfig, match=r"saturation_kv_usage must be in \(0, 1\], got 0"):
        RulesConfig(saturation_kv_usage=0)
    with pytest.raises(InvalidConfig, match="saturation_waiting must be an integer ≥ 1, got 0"):
        RulesConfig(saturation_waiting=0)
