"""The predictive policy's forecasts: damped Holt over per-second counts, and the time-of-day profile."""

from __future__ import annotations

import math

import pytest

from warm_pool.errors import InvalidConfig
from warm_pool.policies.forecast import DayProfile, Forecast, ForecastConfig, Holt

C = ForecastConfig()


def feed(holt: Holt, values) -> Holt:
    for x in values:
        holt = holt.update(x, C)
    return holt


def test_a_constant_rate_is_forecast_flat():
    holt = feed(Holt(), [5] * 600)
    assert holt.forecast(0, C) == pytest.approx(5)
    assert holt.forecast(30, C) == pytest.approx(5, abs=1e-6)


def test_a_rising_rate_is_forecast_ahead_but_the_trend_is_damped():
    holt = feed(Holt(), [0.05 * t for t in range(600)])  # 0 → 30 requests/s over 10 min
    now = holt.forecast(0, C)
    assert now == pytest.approx(30, abs=1.5)
    assert holt.trend > 0
    assert holt.forecast(28, C) > now + 0.2  # ahead of the level
    # however far the horizon, a trend adds at most φ/(1 − φ) = 19 of its steps
    assert holt.forecast(28, C) < holt.forecast(10_000, C) <= now + holt.trend * 19 + 1e-9


def test_the_first_seconds_are_a_plain_mean_not_the_first_sample():
    holt = feed(Holt(), [0, 10, 0, 10, 0, 10])
    assert holt.level == pytest.approx(5, abs=1.0)


def test_the_forecast_is_never_negative():
    assert feed(Holt(), [50] * 30 + [0] * 30).forecast(60, C) >= 0


def daily(t: float) -> int:
    """A day with a busy afternoon: 1 request/s, 20 requests/s from 12:00 to 18:00."""
    return 20 if 43_200 <= t % 86_400 < 64_800 else 1


def test_the_time_of_day_profile_raises_the_forecast_before_the_daily_rush():
    c = ForecastConfig()
    fc = Forecast()
    horizon = 300.0
    seen = {}
    day = 86_400
    for t in range(0, 3 * day - 3600):
        fc = fc.update(((float(t), daily(t)),), c)
        if t == day - 3600 - horizon:  # before a full day of history: no profile yet
            assert fc.profile.rate_at(t + horizon, t, c) is None
            assert fc.rate(t, horizon, c) == pytest.approx(fc.holt.forecast(horizon, c))
        if t == 2 * day + 43_200 - horizon:  # five minutes before the third day's rush
            seen["holt alone"] = fc.holt.forecast(horizon, c)
            seen["with profile"] = fc.rate(t, horizon, c)
            assert fc.profile.rate_at(t + horizon, t, c) == pytest.approx(20)
    # Holt alone still sees the quiet morning; the profile lifts the floor halfway (w = 0.5) to the rush
    assert seen["holt alone"] == pytest.approx(1, abs=0.5)
    assert seen["with profile"] == pytest.approx(0.5 * seen["holt alone"] + 0.5 * 20)


def test_the_profile_stays_one_slot_per_minute_of_the_day():
    c = ForecastConfig()
    p = DayProfile()
    for t in range(0, 2 * 86_400, 7):
        p = p.update(float(t), 1, c)
    assert len(p.rates) == 1440
    assert not any(math.isnan(r) for r in p.rates)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0}, "alpha must be in (0, 1], got 0"),
        ({"phi": 1.0}, "phi must be in (0, 1), got 1.0"),
        ({"slot_s": 7}, "slot_s must divide day_s"),
        ({"profile_weight": 2}, "profile_weight must be in [0, 1], got 2"),
    ],
)
def test_bad_forecast_settings_are_refused(kwargs, message):
    with pytest.raises(
        InvalidConfig, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        ForecastConfig(**kwargs)
