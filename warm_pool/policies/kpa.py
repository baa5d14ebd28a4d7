"""`kpa`: the Knative Pod Autoscaler's decision, as the baseline the other policies are measured by.

Knative's semantics (knative.dev, "Autoscaling" and "Additional autoscaling configuration for KPA";
the defaults of its config-autoscaler), over the averaged per-second concurrency that the tracker
measures (requests in flight plus held, time-weighted within each second, as Knative's
queue-proxies and activator report it):

    per_instance = target_concurrency × target_utilization            (70 %)
    stable = mean concurrency over the stable window                  (60 s)
    panic  = mean concurrency over the panic window                   (10 % of stable: 6 s)
    want_stable = ceil(stable / per_instance),  want_panic = ceil(panic / per_instance)
    both clamped to [floor(ready / max_scale_down_rate), ceil(ready × max_scale_up_rate)],
    ready counted as at least 1                                       (2.0 and 1000)
    panic begins, or is extended, while want_panic / ready ≥ 200 %, and ends a stable window
    after it was last extended; while panicking the answer is the highest of want_panic and
    want_stable seen since panic began (no scale-down), otherwise want_stable.

To zero only when the stable window's mean is exactly zero: a full stable window without traffic.
Knative's scale-to-zero-grace-period (30 s) is an upper bound on waiting for the network to route
through the activator, which Stoker's requests always do; it defaults to 0 here, which makes the
baseline cheaper, not dearer. Knative has no sleeping tier, so neither has this policy.

Worked example, target 10 × 0.7 = 7 per instance, 1 READY, a burst from 0 to 28 concurrent: two
seconds in, the 6 s window's mean is 56/6 = 9.3, want_panic = ceil(9.3/7) = 2, 2/1 ≥ 200 % → panic;
by 6 s it is 28 → want 4, held at 4 until 60 s pass without the threshold being crossed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import TARGET_CONCURRENCY, Decision, Observation, SecondSample
from warm_pool.policies.windows import instances_for, push_seconds


@dataclass(frozen=True)
class KpaConfig:
    target_concurrency: int = TARGET_CONCURRENCY
    max: int = 1
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_pct: float = 10.0
    panic_threshold_pct: float = 200.0
    max_scale_down_rate: float = 2.0
    max_scale_up_rate: float = 1000.0
    scale_to_zero_grace_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise InvalidConfig(
                "target_utilization", f"target_utilization must be in (0, 1], got {self.target_utilization}"
            )
        if not 6 <= self.stable_window_s <= 3600:
            raise InvalidConfig(
                "stable_window_s", f"stable_window_s must be in 6..3600 s, got {self.stable_window_s}"
            )
        if not 1 <= self.panic_window_pct <= 100:
            raise InvalidConfig(
                "panic_window_pct", f"panic_window_pct must be in 1..100, got {self.panic_window_pct}"
            )
        if not 110 <= self.panic_threshold_pct <= 1000:
            raise InvalidConfig(
                "panic_threshold_pct",
                f"panic_threshold_pct must be in 110..1000, got {self.panic_threshold_pct}",
            )
        if self.max_scale_down_rate < 1 or self.max_scale_up_rate < 1:
            raise InvalidConfig("max_scale_down_rate", "max scale-up and scale-down rates must be ≥ 1")
        if self.scale_to_zero_grace_s < 0:
            raise InvalidConfig(
                "scale_to_zero_grace_s",
                f"scale_to_zero_grace_s must be ≥ 0, got {self.scale_to_zero_grace_s}",
            )

    @property
    def panic_window_s(self) -> float:
        return self.stable_window_s * self.panic_window_pct / 100.0


@dataclass(frozen=True)
class KpaState:
    samples: tuple[SecondSample, ...] = ()  # the stable window's seconds: at most 3600 entries
    panic_since: float | None = None  # when panic began or was last extended; None: stable mode
    panic_peak: int = 0  # the highest answer since panic began
    zero_since: float | None = None  # when the answer first became 0 (for the grace period)


def kpa(
    observation: Observation, state: KpaState, now: float, config: KpaConfig
) -> tuple[Decision, KpaState]:
    o, c = observation, config
    samples = push_seconds(state.samples, o.seconds, now, c.stable_window_s)
    panic_samples = push_seconds(samples, (), now, c.panic_window_s)
    stable = sum(s.concurrency for s in samples) / len(samples) if samples else 0.0
    panic = sum(s.concurrency for s in panic_samples) / len(panic_samples) if panic_samples else 0.0

    per_instance = c.target_concurrency * c.target_utilization
    ready = max(1, o.ready)
    lowest, highest = math.floor(ready / c.max_scale_down_rate), math.ceil(ready * c.max_scale_up_rate)
    want_stable = min(max(instances_for(stable, per_instance), lowest), highest)
    want_panic = min(max(instances_for(panic, per_instance), lowest), highest)

    panic_since, panic_peak = state.panic_since, state.panic_peak
    if want_panic / ready >= c.panic_threshold_pct / 100.0:
        panic_since = now  # begin, or extend
    elif panic_since is not None and now - panic_since >= c.stable_window_s:
        panic_since, panic_peak = None, 0

    if panic_since is not None:
        want = max(want_stable, want_panic, panic_peak)
        panic_peak = want
        reason = f"panic: {panic:.1f} concurrent over {c.panic_window_s:g}s → {want_panic}; holding {want}"
    else:
        want = want_stable
        reason = f"stable: {stable:.2f} concurrent over {c.stable_window_s:g}s / {per_instance:g} → {want}"

    zero_since = state.zero_since
    if want > 0:
        zero_since = None
    elif o.ready + o.starting > 0:
        zero_since = now if zero_since is None else zero_since
        if now - zero_since < c.scale_to_zero_grace_s:
            want, reason = 1, f"to zero after a grace of {c.scale_to_zero_grace_s:g}s"
    want = min(want, c.max)
    return Decision(want, reason=reason), KpaState(samples, panic_since, panic_peak, zero_since)
