"""kpa: Knative's stable and panic windows over averaged per-second concurrency, on a fake clock."""

from __future__ import annotations

import pytest

from tests.warm_pool.policy_script import every_second, obs, second
from warm_pool.errors import InvalidConfig
from warm_pool.policies.kpa import KpaConfig, KpaState, kpa

C = KpaConfig(target_concurrency=10, max=10)  # 7 per instance at 70 % utilization


def policy(o, s, now):
    return kpa(o, s, now, C)


def test_a_burst_from_zero_panics_within_the_panic_window_and_never_scales_down_while_panicking():
    state = KpaState()
    quiet, state = every_second(policy, state, 1, 31, lambda t: 0.0, ready=1)
    assert {d.ready for d in quiet} == {0}
    # 28 concurrent from t=30: after two seconds the 6 s window's mean is 56 / 6 = 9.3, which wants
    # ceil(9.3 / 7) = 2 instances: 2 / 1 READY ≥ 200 % → panic; then 14 → 2, 18.7 → 3, 23.3 → 4
    burst, state = every_second(policy, state, 31, 40, lambda t: 28.0, ready=1)
    assert [d.ready for d in burst][:5] == [1, 2, 2, 3, 4]
    assert burst[0].reason.startswith("stable") and burst[1].reason.startswith("panic")
    assert burst[-1].ready == 4  # 28 / 7
    # the burst stops; panicking, the answer holds at its peak for a stable window after the last
    # crossing of the threshold, then the stable mean (still high) takes over
    after, state = every_second(policy, state, 40, 100, lambda t: 0.0, ready=4)
    assert {d.ready for d in after[:30]} == {4}
    assert all(d.reason.startswith("panic") for d in after[:30])
    assert not after[-1].reason.startswith("panic")


def test_a_slowly_rising_load_scales_up_in_stable_mode():
    state, answers = KpaState(), []
    for t in range(1, 600):
        d, state = policy(
            obs(seconds=(second(t - 1, t / 20),), ready=max(1, answers[-1] if answers else 1)), state, t
        )
        answers.append(d.ready)
    assert answers == sorted(answers)  # never down
    assert answers[-1] == 5  # a 60 s mean of 28.4 concurrent / 7 = 4.06
    assert state.panic_since is None


def test_to_zero_only_after_a_full_stable_window_without_traffic():
    state = KpaState()
    _, state = every_second(policy, state, 1, 20, lambda t: 1.0, ready=1)
    # the last busy second is [18, 19): a whole window later, at t=79, the window holds only zeros
    tail, state = every_second(policy, state, 20, 81, lambda t: 0.0, ready=1)
    assert {d.ready for d in tail[: 79 - 20]} == {1}
    assert [d.ready for d in tail][79 - 20 :] == [0, 0]


def test_the_grace_period_holds_the_last_instance():
    config = KpaConfig(target_concurrency=10, max=10, scale_to_zero_grace_s=30)
    state = KpaState()
    d, state = kpa(obs(seconds=(second(0, 1.0),), ready=1), state, 1.0, config)
    for now in range(2, 62):
        d, state = kpa(obs(seconds=(second(now - 1, 0.0),), ready=1), state, float(now), config)
    assert d.ready == 1 and "grace" in d.reason  # zero wanted since t=61, grace to t=91
    d, state = kpa(obs(ready=1), state, 91.0, config)
    assert d.ready == 0


def test_max_caps_and_state_stays_bounded():
    state = KpaState()
    decisions, state = every_second(policy, state, 1, 4000, lambda t: 500.0, ready=10)
    assert decisions[-1].ready == 10
    assert len(state.samples) <= 60


def test_kpa_never_asks_for_sleeping_instances():
    decisions, _ = every_second(policy, KpaState(), 1, 200, lambda t: 5.0 if t < 100 else 0.0, ready=1)
    assert {d.sleeping for d in decisions} == {0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_utilization": 0}, "target_utilization must be in (0, 1], got 0"),
        ({"stable_window_s": 5}, "stable_window_s must be in 6..3600 s, got 5"),
        ({"panic_threshold_pct": 100}, "panic_threshold_pct must be in 110..1000, got 100"),
    ],
)
def test_bad_kpa_settings_are_refused(kwargs, message):
    with pytest.raises(InvalidConfig) as err:
        KpaConfig(**kwargs)
    assert str(err.value) == message
