"""The policies by name, the extended Decision and Observation, and the pool's old call sites."""

from __future__ import annotations

import functools

import pytest

from warm_pool.errors import InvalidConfig
from warm_pool.policies import DEFAULT_POLICY, POLICIES, make_policy, policy_config
from warm_pool.policies.base import Decision, Observation, ScalingConfig
from warm_pool.policies.kpa import KpaConfig
from warm_pool.policies.reactive import PolicyState, reactive


def test_the_four_policies_and_the_reactive_one_are_there_and_predictive_is_the_default():
    assert set(POLICIES) == {"predictive", "kpa", "keepalive", "histogram", "reactive"}
    assert DEFAULT_POLICY == "predictive"


def test_an_unknown_policy_names_the_known_ones():
    with pytest.raises(InvalidConfig) as err:
        make_policy("hpa", ScalingConfig())
    assert (
        str(err.value)
        == "unknown policy 'hpa'; choose one of: predictive, kpa, keepalive, histogram, reactive"
    )


def test_the_deployment_settings_and_overrides_reach_the_config():
    config = policy_config(
        "kpa", ScalingConfig(max=5, target_concurrency=8, stable_window_s=30), panic_window_pct=20
    )
    assert config == KpaConfig(target_concurrency=8, max=5, stable_window_s=30, panic_window_pct=20)
    assert policy_config("reactive", ScalingConfig(max=2), idle_timeout_s=10).idle_timeout_s == 10


def test_an_unknown_or_bad_override_is_a_clear_error():
    with pytest.raises(InvalidConfig, match="policy kpa has no setting 'keepalive_s'; it has: "):
        make_policy("kpa", ScalingConfig(), keepalive_s=5)
    with pytest.raises(InvalidConfig, match=r"target_utilization must be in \(0, 1\], got 2"):
        make_policy("predictive", ScalingConfig(), target_utilization=2)


def test_a_bound_policy_is_pure():
    bound = make_policy("predictive", ScalingConfig(max=4))
    o = Observation(3, 2, 1, 0, 0.5)
    assert bound.decide(o, bound.initial_state, 1.0) == bound.decide(o, bound.initial_state, 1.0)


def test_decision_desired_is_ready_and_old_observations_still_work():
    d = Decision(3, 1, ("snap",), "why", 2.5)
    assert d.desired == 3 and Decision(2).sleeping == 0 and Decision(2).warm == ()
    # the pool's current call: five positional fields, then `reactive` bound with partial
    policy = functools.partial(reactive, config=ScalingConfig(max=2))
    decision, _ = policy(Observation(0, 3, 0, 0, 0.0), PolicyState.initial(), 0.0)
    assert decision.desired == decision.ready == 1
