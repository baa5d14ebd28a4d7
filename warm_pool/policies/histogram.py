"""`histogram`: the hybrid histogram policy of Shahrad et al., "Serverless in the Wild" (ATC 2020).

The paper's policy keeps one application loaded or not; here it decides for the deployment's
instances as a whole, from the idle-gap histogram (`idle_histogram.py`: the bins, percentiles,
margins and the representativeness test):

- busy (requests in flight or held): keep what the load needs, the highest per-second need of the
  last `window_s` (60 s, as kpa's stable window), at least one.
- idle, histogram representative, with (pre-warm point, keep-alive end) = (head × 0.9, tail × 1.1):
  unload at once, load again at pre-warm point − start-up lead, and unload at keep-alive end. A
  pre-warm point within the lead means "keep loaded from the start of the gap" (the paper's
  pre-warm window of 0). The paper pre-warms at the pre-warm point itself; subtracting the measured
  start-up time of the tier the instance would come from makes it READY by then instead of
  starting then, which matters when a start takes 28 s and gaps last 60.
- idle, histogram not representative: the fixed keep-alive fallback (`keepalive_s`, 600 s).

While loaded, the load window's instances stay too; when unloaded, all go (a 30 s flap delay from
the shared rules may hold them a little). No sleeping: the paper's unload and pre-warm act on
whole processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import TARGET_CONCURRENCY, Decision, Observation
from warm_pool.policies.idle_histogram import HistogramConfig, IdleHistogram
from warm_pool.policies.windows import Peak, instances_for, peak, push_peak


@dataclass(frozen=True)
class HistogramPolicyConfig:
    target_concurrency: int = TARGET_CONCURRENCY
    max: int = 1
    target_utilization: float = 0.7
    window_s: float = 60.0
    keepalive_s: float = 600.0  # the fallback
    histogram: HistogramConfig = field(default_factory=HistogramConfig)

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise InvalidConfig(
                "target_utilization", f"target_utilization must be in (0, 1], got {self.target_utilization}"
            )
        for name in ("window_s", "keepalive_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidConfig(name, f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class HistogramState:
    histogram: IdleHistogram = field(default_factory=IdleHistogram)
    peaks: Peak = ()


def loaded_by_histogram(
    histogram: IdleHistogram, config: HistogramConfig, idle_for: float, lead_s: float, fallback_s: float
) -> tuple[bool, str]:
    """Whether an idle deployment `idle_for` seconds into its gap should have an instance READY."""
    windows = histogram.windows(config)
    if windows is None:
        keep = idle_for < fallback_s
        return keep, f"histogram not representative ({histogram.total:.0f} gaps): keep-alive {fallback_s:g}s"
    prewarm, keep_until = windows
    load_at = prewarm - lead_s
    keep = load_at <= idle_for < keep_until
    return keep, f"idle {idle_for:.0f}s; loaded from {max(load_at, 0):.0f}s to {keep_until:.0f}s"


def histogram(
    observation: Observation, state: HistogramState, now: float, config: HistogramPolicyConfig
) -> tuple[Decision, HistogramState]:
    o, c = observation, config
    hist = state.histogram.add(o.idle_gaps, c.histogram)
    per_instance = c.target_concurrency * c.target_utilization
    peaks = state.peaks
    for s in o.seconds:
        peaks = push_peak(
            peaks, s.start + 1.0, min(instances_for(s.concurrency, per_instance), c.max), c.window_s
        )
    demand = o.in_flight + o.queued
    held = peak(peaks, now, c.window_s)

    if demand > 0:
        want, reason = max(held, 1), f"busy: highest need in the last {c.window_s:g}s"
    elif o.idle_since is None and o.last_arrival is None:
        want, reason = 0, "no traffic yet"
    else:
        since = o.idle_since if o.idle_since is not None else o.last_arrival
        idle_for = max(0.0, now - since)
        loaded, reason = loaded_by_histogram(
            hist, c.histogram, idle_for, o.startup.of(o.start_tier), c.keepalive_s
        )
        want = max(held, 1) if loaded else 0
    return Decision(min(want, c.max), reason=reason), HistogramState(hist, peaks)
