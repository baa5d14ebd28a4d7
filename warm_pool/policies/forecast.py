"""Arrival-rate forecasts for the predictive policy: a damped Holt linear trend over per-second
counts, and a time-of-day profile blended in once the history spans a day. Pure and bounded.

Damped Holt (Gardner & McKenzie), one step per whole second, x = that second's arrivals:

    level' = α·x + (1 − α)·(level + φ·trend)
    trend' = β·(level' − level) + (1 − β)·φ·trend
    forecast(h) = level + trend·(φ + φ² + … + φ^h) = level + trend·φ·(1 − φ^h)/(1 − φ)

α = 2/61 ≈ 0.033 gives the level the memory of Knative's 60 s stable window (an exponential
average with α = 2/(N + 1) has the mean age of an N-sample window): at 5 requests/s a Poisson
count varies ±45 % second to second, the level ±6 %. Bursts are not the forecast's job: the shared
rules' reactive floor answers them at once, and the sleeping tier makes that answer a wake. β =
0.02 smooths the trend over ~100 s, the time scale of the slow drifts a start-up lead can use.
φ = 0.95 caps what a trend can add at φ/(1 − φ) = 19 seconds' worth, however far the horizon:
about one page-cache start (a 60 s download would otherwise extrapolate a short slope 60 s on).
Measured on the shared traces, the trend buys little (their rises are slow next to a 28 s start,
and KPA's 30 % headroom absorbs them too) and costs ~1 % GPU-seconds on the rising chat trace.

The profile keeps one mean rate per minute of the day (1440 slots; day = 86400 s of the caller's
clock, so a monotonic clock works: only the period matters, not where midnight falls), each an
exponential average over days (weight 0.5 for the newest day). Once the history spans a whole day,
the forecast for `now + h` is (1 − w)·Holt + w·profile[slot of now + h], w = 0.5: yesterday's
rush hour raises the floor before today's begins, and today's own level still counts as much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from warm_pool.errors import InvalidConfig


@dataclass(frozen=True)
class ForecastConfig:
    alpha: float = 2 / 61
    beta: float = 0.02
    phi: float = 0.95
    day_s: float = 86400.0
    slot_s: float = 60.0
    day_weight: float = 0.5  # weight of the newest day in a profile slot
    profile_weight: float = 0.5  # w above

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "day_weight"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise InvalidConfig(name, f"{name} must be in (0, 1], got {value}")
        if not 0 < self.phi < 1:
            raise InvalidConfig("phi", f"phi must be in (0, 1), got {self.phi}")
        if not 0 <= self.profile_weight <= 1:
            raise InvalidConfig(
                "profile_weight", f"profile_weight must be in [0, 1], got {self.profile_weight}"
            )
        slots = self.day_s / self.slot_s
        if not (self.slot_s >= 1 and slots == int(slots) and 1 <= slots <= 10_000):
            raise InvalidConfig(
                "slot_s", f"slot_s must divide day_s into 1..10000 slots, got {self.slot_s}, {self.day_s}"
            )

    @property
    def slots(self) -> int:
        return int(self.day_s / self.slot_s)


@dataclass(frozen=True)
class Holt:
    level: float = 0.0
    trend: float = 0.0
    seen: int = 0  # seconds counted, up to 1/α: while fewer, the level's weight is 1/seen

    def update(self, x: float, c: ForecastConfig) -> Holt:
        # A plain running mean (weight 1/n) until 1/α seconds are in: starting the level at the
        # first second's count would bias it for a minute towards one noisy sample.
        n = self.seen + 1
        alpha = max(c.alpha, 1 / n)
        level = alpha * x + (1 - alpha) * (self.level + c.phi * self.trend)
        trend = c.beta * (level - self.level) + (1 - c.beta) * c.phi * self.trend if n > 1 else 0.0
        return Holt(level, trend, min(n, math.ceil(1 / c.alpha)))

    def forecast(self, horizon_s: float, c: ForecastConfig) -> float:
        h = max(0.0, horizon_s)
        return max(0.0, self.level + self.trend * c.phi * (1 - c.phi**h) / (1 - c.phi))


@dataclass(frozen=True)
class DayProfile:
    rates: tuple[float, ...] = ()  # per slot, requests/s; NaN where no day has filled it yet
    first: float | None = None  # start of the first second seen
    slot_start: float | None = None  # start of the slot being counted
    count: int = 0  # arrivals in it so far

    def update(self, start: float, arrivals: int, c: ForecastConfig) -> DayProfile:
        """Count one whole second [start, start + 1)."""
        first = self.first if self.first is not None else start
        slot_start = math.floor(start / c.slot_s) * c.slot_s
        if self.slot_start is None or slot_start == self.slot_start:
            return DayProfile(self.rates, first, slot_start, self.count + arrivals)
        rates = self._closed(c)
        return DayProfile(rates, first, slot_start, arrivals)

    def _closed(self, c: ForecastConfig) -> tuple[float, ...]:
        """The rates with the slot being counted folded in (a slot only partly seen counts as seen)."""
        assert self.slot_start is not None
        rates = list(self.rates) or [math.nan] * c.slots
        index = int(self.slot_start % c.day_s // c.slot_s)
        rate = self.count / c.slot_s
        old = rates[index]
        rates[index] = rate if math.isnan(old) else old + c.day_weight * (rate - old)
        return tuple(rates)

    def rate_at(self, t: float, now: float, c: ForecastConfig) -> float | None:
        """The profile's rate for the slot holding time `t`, once the history spans a day."""
        if self.first is None or now - self.first < c.day_s or not self.rates:
            return None
        rate = self.rates[int(t % c.day_s // c.slot_s)]
        return None if math.isnan(rate) else rate


@dataclass(frozen=True)
class Forecast:
    holt: Holt = field(default_factory=Holt)
    profile: DayProfile = field(default_factory=DayProfile)

    def update(self, seconds: tuple[tuple[float, int], ...], c: ForecastConfig) -> Forecast:
        """Feed whole seconds, as (start, arrivals), oldest first."""
        holt, profile = self.holt, self.profile
        for start, arrivals in seconds:
            holt = holt.update(arrivals, c)
            profile = profile.update(start, arrivals, c)
        return Forecast(holt, profile)

    def rate(self, now: float, horizon_s: float, c: ForecastConfig) -> float:
        """Requests/s expected at `now + horizon_s`."""
        trend = self.holt.forecast(horizon_s, c)
        daily = self.profile.rate_at(now + horizon_s, now, c)
        if daily is None:
            return trend
        return (1 - c.profile_weight) * trend + c.profile_weight * daily
