"""The sleeping tier survives short idle timeouts: an idle instance of a policy that sleeps goes
READY → SLEEPING → STOPPED, with a SLEEPING phase of non-zero length, whatever the idle timeout and
the stable window (`warm_pool.policies.predictive`, step 3; `warm_pool.policies.settings`).

Pure functions on a logical clock: the policy is bound as the platform binds it (the stable window
capped at the idle timeout, `stoker.control.platform.Platform.scaling`), and one instance follows its
decisions call by call."""

from __future__ import annotations

import pytest

from tests.warm_pool.policy_script import obs
from warm_pool.policies.base import ScalingConfig
from warm_pool.policies.predictive import PredictiveConfig, PredictiveState, predictive
from warm_pool.policies.settings import MIN_SLEEPING_IDLE_S, bind_policy, idle_timeout_error

STEP_S = 0.25  # the logical clock's step: finer than the pool's 1 s tick


def phases(
    idle_timeout_s: float, window_s: float, idle_gaps: tuple[float, ...] = ()
) -> list[tuple[str, float]]:
    """(phase, seconds into the idle gap it began) for one instance: a request arrives at t = 0,
    is served until t = 1, then nothing more comes until the instance is stopped."""
    scaling = ScalingConfig(
        max=1, idle_timeout_s=idle_timeout_s, stable_window_s=min(window_s, idle_timeout_s)
    )
    bound = bind_policy("predictive", scaling)
    state = bound.initial_state
    d, state = bound.decide(obs(queued=1, last_arrival=0.0, idle_gaps=idle_gaps), state, 0.0)
    assert d.ready == 1  # the cold start
    d, state = bound.decide(obs(ready=1, in_flight=1, last_arrival=0.0), state, 0.5)
    out: list[tuple[str, float]] = [("READY", 0.0)]
    t = 1.0
    while out[-1][0] != "STOPPED":
        current = out[-1][0]
        o = obs(
            ready=1 if current == "READY" else 0,
            sleeping=1 if current == "SLEEPING" else 0,
            start_tier="wake" if current == "SLEEPING" else "disk",
            idle_since=1.0,
            last_arrival=0.0,
        )
        d, state = bound.decide(o, state, t)
        now = "READY" if d.ready >= 1 else "SLEEPING" if d.sleeping >= 1 else "STOPPED"
        if now != current:
            out.append((now, t - 1.0))
        t += STEP_S
        assert t < idle_timeout_s + 10, f"not stopped by the idle timeout: {out}"
    return out


@pytest.mark.parametrize(
    ("idle_timeout_s", "window_s", "asleep_at"),
    [
        (20.0, 60.0, 10.0),  # shorter than the window: the window is capped to 20, READY for half of 20
        (60.0, 60.0, 30.0),  # equal: half the idle timeout
        (300.0, 60.0, 60.0),  # longer: the stable window, as before
        (5.0, 1.0, 1.0),  # a short window: the window
        (MIN_SLEEPING_IDLE_S, 60.0, MIN_SLEEPING_IDLE_S / 2),  # the shortest a sleeping policy takes
    ],
)
def test_an_idle_instance_sleeps_before_the_idle_timeout_stops_it(idle_timeout_s, window_s, asleep_at):
    got = phases(idle_timeout_s, window_s)
    assert [p for p, _ in got] == ["READY", "SLEEPING", "STOPPED"], got
    (_, _), (_, slept), (_, stopped) = got
    assert slept == pytest.approx(asleep_at, abs=STEP_S)
    assert stopped == pytest.approx(idle_timeout_s, abs=STEP_S)
    assert stopped - slept >= idle_timeout_s / 2 - STEP_S  # the second half of the idle timeout asleep


def test_a_representative_histogram_is_ready_only_in_the_first_half_of_the_idle_timeout():
    # gaps of 50-58 s: pre-warm at 0.9 × 50 = 45 s, keep until ~1.1 × 58 = 64 s; idle timeout 120 s
    gaps = (50.0, 52.0, 54.0, 56.0, 58.0) * 3
    got = phases(120.0, 60.0, idle_gaps=gaps)
    assert [p for p, _ in got] == ["READY", "SLEEPING", "READY", "SLEEPING", "STOPPED"], got
    woken, slept_again, stopped = got[2][1], got[3][1], got[4][1]
    assert woken < 45.0  # pre-warmed a wake and a margin ahead of the expected arrival
    assert slept_again == pytest.approx(60.0, abs=STEP_S)  # not 64 s: half of the idle timeout
    assert stopped == pytest.approx(120.0, abs=STEP_S)


def test_an_expected_arrival_past_half_the_idle_timeout_is_met_asleep():
    # gaps of ~100 s, idle timeout 150 s: the pre-warm (~87 s) lies past 75 s: a wake away instead
    gaps = (100.0, 101.0, 102.0) * 4
    got = phases(150.0, 60.0, idle_gaps=gaps)
    assert [p for p, _ in got] == ["READY", "SLEEPING", "STOPPED"], got
    assert got[2][1] == pytest.approx(150.0, abs=STEP_S)


@pytest.mark.parametrize(
    ("fallback_s", "keepalive_s", "ready_until"),
    [(20.0, 20.0, 10.0), (60.0, 20.0, 10.0), (30.0, 1800.0, 30.0), (30.0, 40.0, 20.0)],
)
def test_the_fallback_is_capped_at_half_the_idle_timeout_however_the_policy_is_configured(
    fallback_s, keepalive_s, ready_until
):
    c = PredictiveConfig(fallback_ready_s=fallback_s, sleep_keepalive_s=keepalive_s)

    def at(idle_for: float) -> tuple[int, int]:
        d, _ = predictive(obs(ready=1, idle_since=0.0, last_arrival=0.0), PredictiveState(), idle_for, c)
        return d.ready, d.sleeping

    assert at(ready_until - 0.01) == (1, 0)
    assert at(ready_until) == (0, 1)
    assert at(keepalive_s - 0.01) == (0, 1)
    assert at(keepalive_s) == (0, 0)


def test_an_idle_timeout_too_short_to_sleep_is_refused_for_a_policy_that_sleeps():
    assert idle_timeout_error("predictive", MIN_SLEEPING_IDLE_S) is None
    message = idle_timeout_error("predictive", 1.0)
    assert message is not None and "1s" in message and "2s" in message and "\n" not in message
    for policy in ("reactive", "kpa", "keepalive", "histogram"):  # they never sleep: any timeout
        assert idle_timeout_error(policy, 1.0) is None
