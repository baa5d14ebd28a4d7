"""Under a steady but noisy load no policy flaps: a step down never follows a step up within the
rules' delay, and predictive reverses direction no more often than kpa."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from warm_pool.policies import make_policy
from warm_pool.policies.base import ScalingConfig
from warm_pool.policies.rules import RulesConfig
from warm_pool.simulate import simulate
from warm_pool.trace import TraceRequest

SCALING = ScalingConfig(max=16, target_concurrency=16)
NO_FLAP_SUPPRESSION = RulesConfig(down_delay_s=0, sleep_delay_s=0, down_step_s=0, max_down_rate=1000)


def poisson_trace(rate: float, seconds: float, seed: int = 5) -> tuple[TraceRequest, ...]:
    # 1000 prompt + 100 generated tokens: 2.6 s on the GPU model; 8.6/s ≈ 22 in flight, which sits
    # on the boundary between 2 and 3 instances at 16 × 70 % = 11.2 each: the worst case for flapping
    rng, t, out = random.Random(seed), 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, 1000, 100))
    return tuple(out)


def decisions(name: str, trace, rules: RulesConfig | None = None) -> list[tuple[float, int]]:
    bound = make_policy(name, SCALING, rules)
    seen: list[tuple[float, int]] = []

    def recording(o, state, now):
        d, state = bound.decide(o, state, now)
        seen.append((now, d.ready))
        return d, state

    simulate(trace, replace(bound, decide=recording), scaling=SCALING)
    return seen


def too_soon_after_a_step_up(seen: list[tuple[float, int]], delay_s: float) -> int:
    last_up, bad = None, 0
    for (_, before), (now, after) in itertools.pairwise(seen):
        if after > before:
            last_up = now
        elif after < before and last_up is not None and now - last_up < delay_s:
            bad += 1
    return bad


def reversals(seen: list[tuple[float, int]]) -> int:
    steps = [1 if b > a else -1 for (_, a), (_, b) in itertools.pairwise(seen) if b != a]
    return sum(1 for a, b in itertools.pairwise(steps) if a != b)


@pytest.fixture(scope="module")
def noisy():
    return poisson_trace(8.6, 1200.0)


@pytest.mark.parametrize("name", ["predictive", "kpa", "keepalive", "histogram"])
def test_no_step_down_comes_within_the_delay_of_a_step_up(noisy, name):
    assert too_soon_after_a_step_up(decisions(name, noisy), RulesConfig().sleep_delay_s) == 0


def test_the_check_catches_flapping_when_the_rules_do_not_suppress_it(noisy):
    assert too_soon_after_a_step_up(decisions("kpa", noisy, NO_FLAP_SUPPRESSION), 10.0) > 0


def test_predictive_reverses_no_more_often_than_kpa(noisy):
    ours, knative = reversals(decisions("predictive", noisy)), reversals(decisions("kpa", noisy))
    assert ours <= knative
    assert ours <= 20  # in 20 minutes: at most one a minute
