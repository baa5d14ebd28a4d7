"""The rules every policy is held to, applied once around any of them: `with_rules(policy, scaling)`.

In the order they apply to the policy's `ready`:

1. Reactive floor: at least ceil((in_flight + queued) / target_concurrency) READY at once, so a
   forecast or a histogram can only add capacity, never refuse what has already arrived. It
   contains the cold-start fast path: a request held with nothing ready, starting or waking asks
   for one instance on the call that first sees it.
2. Bounds: `min_warm` ≤ ready ≤ `max`.
3. Flap suppression, for scale-down only (scale-up is never delayed):
   - no step down within `down_delay_s` (30 s) of the last step up. An instance let go sooner
     than a new one takes to start is a flap by definition, and the slowest local start here is
     ~28 s (GPU class, disk tier: `TierTimes.disk`); keeping an instance for one start-up time is
     also the break-even of the ski-rental argument (idle cost = restart cost). 30 s also averages
     per-second noise: Poisson arrivals at 5 requests/s vary ±45 % per second, ±8 % over 30 s.
   - `sleep_delay_s` (10 s) instead when every instance leaving READY goes to sleep (the SLEEPING
     asked for exceeds those asleep now by as much as READY shrinks): a sleep is undone by a wake
     (~1 s), not a start, so the same break-even is a second or two, and 10 s is still ten loop
     ticks of hysteresis. Measured on the bursty code trace, 10 s rather than 30 s cuts
     predictive's GPU-seconds by a sixth for the same cold starts.
   - at most one step down per `down_step_s` (2 s), and a step at most halves READY: Knative's
     max-scale-down-rate 2.0 per 2 s tick. A drained burst of 8 instances reaches 1 in 6 s
     (8 → 4 → 2 → 1), so the rate limit costs little, but one noisy sample cannot empty the pool.
4. Sleeping: ready + sleeping ≤ `max` (the sleeping count gives way).

The wrapped state is `RuledState(inner=<the policy's own state>, ...)`; start from
`RuledState(inner=<its initial state>)`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from warm_pool.errors import InvalidConfig
from warm_pool.policy import Decision, Observation, Policy, ScalingConfig


@dataclass(frozen=True)
class RulesConfig:
    down_delay_s: float = 30.0
    sleep_delay_s: float = 10.0
    down_step_s: float = 2.0
    max_down_rate: float = 2.0

    def __post_init__(self) -> None:
        for name in ("down_delay_s", "sleep_delay_s", "down_step_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidConfig(name, f"{name} must be a finite number ≥ 0, got {value!r}")
        if not (isinstance(self.max_down_rate, int | float) and self.max_down_rate >= 1):
            raise InvalidConfig("max_down_rate", f"max_down_rate must be ≥ 1, got {self.max_down_rate!r}")


@dataclass(frozen=True)
class RuledState:
    inner: Any  # the wrapped policy's own state
    last_ready: int = 0  # what the rules answered last time
    last_up: float | None = None  # when READY was last raised
    last_down: float | None = None  # when READY was last lowered


def ruled(
    observation: Observation,
    state: RuledState,
    now: float,
    *,
    policy: Policy,
    scaling: ScalingConfig,
    rules: RulesConfig,
) -> tuple[Decision, RuledState]:
    o, c = observation, scaling
    decision, inner = policy(o, state.inner, now)
    reason = decision.reason

    demand = o.in_flight + o.queued
    floor = math.ceil(demand / c.target_concurrency)
    ready = max(decision.ready, 0)
    if ready < floor:
        ready = floor
        if o.queued and o.ready + o.starting + o.waking == 0:
            reason = f"cold start: {o.queued} queued, nothing ready, starting or waking"
        else:
            reason = f"reactive floor: ceil({demand}/{c.target_concurrency}) = {floor}"
    if ready < c.min_warm:
        ready, reason = c.min_warm, f"min_warm {c.min_warm}"
    if ready > c.max:
        ready, reason = c.max, f"capped at max {c.max}: {reason}"

    prev = state.last_ready
    if ready < prev:
        lowest = max(ready, math.floor(prev / rules.max_down_rate))
        to_sleep = decision.sleeping >= o.sleeping + (prev - ready)  # every one leaving READY sleeps
        delay = rules.sleep_delay_s if to_sleep else rules.down_delay_s
        if state.last_up is not None and now - state.last_up < delay:
            ready = min(prev, c.max)
            reason = f"holding {ready}: scaled up {now - state.last_up:.0f}s ago ({reason})"
        elif state.last_down is not None and now - state.last_down < rules.down_step_s:
            ready = min(prev, c.max)
            reason = f"holding {ready}: stepped down {now - state.last_down:.1f}s ago ({reason})"
        elif lowest > ready:
            ready = lowest
            reason = f"stepping down to {ready} (at most halving) ({reason})"

    sleeping = min(max(decision.sleeping, 0), c.max - ready)
    last_up = now if ready > prev else state.last_up
    last_down = now if ready < prev else state.last_down
    out = Decision(ready, sleeping, decision.warm, reason, decision.forecast)
    return out, RuledState(inner, ready, last_up, last_down)


def with_rules(
    policy: Policy, scaling: ScalingConfig, rules: RulesConfig | None = None
) -> Policy[RuledState]:
    """`policy` held to the shared rules; its state is a `RuledState` wrapping the policy's own."""
    return functools.partial(ruled, policy=policy, scaling=scaling, rules=rules or RulesConfig())
