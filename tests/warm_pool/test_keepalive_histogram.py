"""keepalive and histogram (Shahrad et al.), and the idle-gap histogram they and predictive share."""

from __future__ import annotations

import pytest

from tests.warm_pool.policy_script import every_second, obs
from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import TierTimes
from warm_pool.policies.histogram import HistogramPolicyConfig, HistogramState, histogram
from warm_pool.policies.idle_histogram import HistogramConfig, IdleHistogram
from warm_pool.policies.keepalive import KeepaliveConfig, KeepaliveState, keepalive

H = HistogramConfig()


# ---- the idle-gap histogram --------------------------------------------------------------------------


def test_percentiles_use_the_lower_bin_edge_for_the_head_and_the_upper_for_the_tail():
    hist = IdleHistogram().add((60.2, 61.5, 62.9, 64.0, 70.4) * 4, H)
    assert hist.percentile(5, H, upper=False) == 60.0
    assert hist.percentile(99, H, upper=True) == 71.0
    assert hist.windows(H) == pytest.approx((60 * 0.9, 71 * 1.1))


@pytest.mark.parametrize(
    ("gaps", "representative"),
    [
        ((30.0,) * 4, False),  # too few
        ((30.0,) * 10, True),  # a sharp peak: CV far above 2
        ((700.0,) * 10, False),  # beyond range
        (tuple(float(g) for g in range(0, 600, 1)), False),  # flat: CV 0
    ],
)
def test_representative_needs_samples_in_range_and_a_peaked_histogram(gaps, representative):
    assert IdleHistogram().add(gaps, H).representative(H) is representative


def test_counts_halve_when_full_so_old_gaps_fade_and_the_state_stays_small():
    config = HistogramConfig(max_samples=100)
    hist = IdleHistogram().add((10.0,) * 1000, config)
    assert hist.total < 100
    hist = hist.add((50.0,) * 200, config)  # the new regime takes over
    assert hist.percentile(50, config, upper=False) == 50.0
    assert len(hist.counts) == config.bins == 600


def test_bad_histogram_settings_are_refused():
    with pytest.raises(InvalidConfig, match="head_pct < tail_pct"):
        HistogramConfig(head_pct=99, tail_pct=5)


# ---- keepalive -------------------------------------------------------------------------------------


def test_keepalive_holds_the_peak_need_for_ten_minutes_after_the_last_second_that_needed_it():
    config = KeepaliveConfig(target_concurrency=10, max=8)
    policy = lambda o, s, now: keepalive(o, s, now, config)  # noqa: E731
    load = lambda t: 20.0 if t < 10 else (3.0 if t < 30 else 0.0)  # noqa: E731
    decisions, state = every_second(policy, KeepaliveState(), 1, 700, load, ready=1)
    answers = [d.ready for d in decisions]
    assert answers[5] == 3  # ceil(20 / 7)
    assert answers[100] == 3  # the burst's three are kept too
    assert answers[609 - 1] == 3 and answers[610 - 1] == 1  # [9, 10) needed 3: kept until 610
    assert answers[629 - 1] == 1 and answers[630 - 1] == 0  # [29, 30) needed 1: kept until 630
    assert {d.sleeping for d in decisions} == {0}
    assert len(state.peaks) <= config.max + 1


# ---- histogram -------------------------------------------------------------------------------------


def test_histogram_pre_warms_a_start_lead_before_the_next_expected_arrival():
    config = HistogramPolicyConfig(target_concurrency=4, max=4)
    startup = TierTimes(page_cache=20.0)
    state = HistogramState()
    # ten idle gaps of 100-102 s seen: pre-warm point 0.9 × 100 = 90 s, keep until 1.1 × 103 = 113.3 s
    _, state = histogram(obs(idle_gaps=(100.0, 101.0, 102.0) * 3 + (101.5,), ready=1), state, 0.0, config)

    def ready_at(idle_for: float) -> int:
        o = obs(ready=1, idle_since=1000.0, last_arrival=999.0, startup=startup, start_tier="page_cache")
        return histogram(o, state, 1000.0 + idle_for, config)[0].ready

    assert [ready_at(s) for s in (0, 69.9, 70, 100, 113.2, 113.4, 500)] == [0, 0, 1, 1, 1, 0, 0]


def test_histogram_falls_back_to_a_fixed_keepalive_while_not_representative():
    config = HistogramPolicyConfig(target_concurrency=4, max=4, keepalive_s=600)
    o = obs(ready=1, idle_since=0.0, last_arrival=0.0, idle_gaps=(40.0,))
    d, state = histogram(o, HistogramState(), 599.0, config)
    assert d.ready == 1 and "not representative" in d.reason
    assert histogram(obs(ready=1, idle_since=0.0, last_arrival=0.0), state, 600.0, config)[0].ready == 0


def test_histogram_keeps_at_least_one_while_busy_and_nothing_before_any_traffic():
    config = HistogramPolicyConfig(target_concurrency=4, max=4)
    assert histogram(obs(), HistogramState(), 0.0, config)[0].ready == 0
    assert histogram(obs(in_flight=1, ready=1, last_arrival=0.0), HistogramState(), 0.0, config)[0].ready == 1
