"""`keepalive`: AWS Lambda's fixed keep-alive, the classic serverless baseline.

Every instance the load needed in some second is kept for `keepalive_s` (default 600 s, Lambda's
10 minutes) after that second: the answer is the highest per-second need of the last `keepalive_s`,
so the last instance goes 10 minutes after the last request, and a burst's instances 10 minutes
after the burst. The need of a second is ceil(its mean concurrency / (target × utilization)), the
same per-instance target as `kpa` and `predictive`, so the policies differ only in when they hold
capacity, not in how much a request needs. No sleeping: a fixed keep-alive knows one idle tier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import TARGET_CONCURRENCY, Decision, Observation
from warm_pool.policies.windows import Peak, instances_for, peak, push_peak


@dataclass(frozen=True)
class KeepaliveConfig:
    target_concurrency: int = TARGET_CONCURRENCY
    max: int = 1
    target_utilization: float = 0.7
    keepalive_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise InvalidConfig(
                "target_utilization", f"target_utilization must be in (0, 1], got {self.target_utilization}"
            )
        if not (math.isfinite(self.keepalive_s) and self.keepalive_s > 0):
            raise InvalidConfig(
                "keepalive_s", f"keepalive_s must be a finite number > 0, got {self.keepalive_s}"
            )


@dataclass(frozen=True)
class KeepaliveState:
    peaks: Peak = ()  # per-second needs of the last keepalive_s: at most max + 1 entries


def keepalive(
    observation: Observation, state: KeepaliveState, now: float, config: KeepaliveConfig
) -> tuple[Decision, KeepaliveState]:
    o, c = observation, config
    per_instance = c.target_concurrency * c.target_utilization
    peaks = state.peaks
    for s in o.seconds:
        if s.concurrency > 0 or s.arrivals > 0:
            need = min(max(1, instances_for(s.concurrency, per_instance)), c.max)
            peaks = push_peak(peaks, s.start + 1.0, need, c.keepalive_s)
    if o.in_flight + o.queued > 0:
        peaks = push_peak(
            peaks, now, min(instances_for(o.in_flight + o.queued, per_instance), c.max), c.keepalive_s
        )
    want = peak(peaks, now, c.keepalive_s)
    peaks = tuple((t, v) for t, v in peaks if now - t < c.keepalive_s)
    reason = f"keep-alive: highest need in the last {c.keepalive_s:g}s is {want}"
    return Decision(want, reason=reason), KeepaliveState(peaks)
