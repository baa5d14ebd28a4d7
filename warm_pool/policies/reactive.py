"""The reactive scaling policy: a pure function of what the pool observed, its last state and `now`.

    desired = ceil((in_flight + queued) / target_concurrency), bounded by [min_warm, max]

Up at once: the current value counts as soon as it is seen, so a request queued at zero asks for
one instance on the call it is first observed (the cold-start fast path). Down slowly: the policy
answers the highest bounded value seen in the last `stable_window_s`, so a dip must last a whole
window before an instance goes. To zero (min_warm 0) only after `idle_timeout_s` with no arrival
and nothing in flight or queued; until then at least one instance is kept once one exists or was
wanted. A full idle timeout also ends any window hold: idleness, not the window, decides the last
step, so a short idle timeout takes effect even with the default 60 s window.

Worked example, target 4, window 60 s, idle timeout 300 s, observed at t=0 with 10 requests in
flight and at t=10 with none: t=0 → ceil(10/4) = 3; t=10 → still 3 (the t=0 sample is in the
window); t=60 → the window holds only zeros, but the last activity was t=0, so 1 is kept; t=300 → 0.

No clock reads, no I/O: the live loop and the simulator call the same function.

The shared types (`Observation`, `Decision`, `ScalingConfig`) live in `warm_pool.policies.base`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warm_pool.policies.base import Decision, Observation, ScalingConfig


@dataclass(frozen=True)
class PolicyState:
    # (time, bounded desired) samples of the last window, times rising and values falling: a sample
    # at or below a newer one can never be the window's maximum again, so it is dropped on arrival.
    # That keeps at most max+1 entries however often the policy is called.
    history: tuple[tuple[float, int], ...] = ()
    last_active: float | None = None  # last time anything was in flight, queued or arriving
    last_desired: int = 0

    @classmethod
    def initial(cls) -> PolicyState:
        return cls()


def reactive(
    observation: Observation, state: PolicyState, now: float, config: ScalingConfig
) -> tuple[Decision, PolicyState]:
    o, c = observation, config
    demand = o.in_flight + o.queued
    raw = math.ceil(demand / c.target_concurrency)
    bounded = min(max(raw, c.min_warm), c.max)

    last_active = state.last_active
    if demand > 0:
        last_active = now
    if o.last_arrival is not None and (last_active is None or o.last_arrival > last_active):
        last_active = o.last_arrival
    idle_for = math.inf if last_active is None else now - last_active

    if idle_for >= c.idle_timeout_s:
        # Idle long enough: the window's memory of busier times no longer matters.
        history: tuple[tuple[float, int], ...] = ((now, bounded),)
    else:
        kept = [(t, v) for t, v in state.history if now - t < c.stable_window_s and v > bounded]
        history = (*kept, (now, bounded))
    desired = history[0][1]  # values fall along the tuple: the first is the window's maximum

    if raw > c.max:
        reason = f"capped at max {c.max}: {demand} requests want {raw}"
    elif desired > bounded:
        reason = f"holding {desired}: highest in the last {c.stable_window_s:g}s (now {bounded})"
    elif raw < c.min_warm:
        reason = f"min_warm {c.min_warm}"
    elif o.queued and o.ready + o.starting == 0:
        reason = f"cold start: {o.queued} queued, nothing ready or starting"
    else:
        reason = f"load: ceil({demand}/{c.target_concurrency}) = {raw}"

    if desired == 0 and (o.ready + o.starting > 0 or state.last_desired > 0):
        if idle_for < c.idle_timeout_s:
            desired = 1
            reason = f"holding 1 until idle for {c.idle_timeout_s:g}s (idle {idle_for:.1f}s)"
        else:
            reason = f"idle for {c.idle_timeout_s:g}s: to zero"

    return Decision(desired, reason=reason), PolicyState(history, last_active, desired)
