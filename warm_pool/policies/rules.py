"""The rules every policy is held to, applied once around any of them: `with_rules(policy, scaling)`.

In the order they apply to the policy's `ready`:

1. Reactive floor: at least ceil((in_flight + queued) / target_concurrency) READY at once, so a
   forecast or a histogram can only add capacity, never refuse what has already arrived. It
   contains the cold-start fast path: a request held with nothing ready, starting or waking asks
   for one instance on the call that first sees it.
2. Saturation: when the READY instances' engines hold `saturation_waiting` (1) or more requests
   waiting inside them, or their KV caches are on average `saturation_kv_usage` (90 %) full or
   more, at least READY + 1. The activator's counts cannot see this: it sends an instance no more
   than its batch size, so a request waits inside an engine only when the engine could not batch
   it for want of KV blocks (vLLM preempts a running sequence back to waiting when its cache is
   full), which long contexts do at fewer requests than `target_concurrency` allows. Why 90 %: an
   8B model on an 80 GB GPU has ~50 GB of KV cache at 128 KiB a token (32 layers × 8 KV heads ×
   128 × K and V × 2 bytes), ~400k tokens; the last 10 % is 40k tokens, which 16 streams decoding
   40 tokens/s each fill in 40000 / 640 ≈ 60 s, two disk starts (28 s): the new instance is READY
   before preemption begins. One instance per step: the figures are read every 5 s and a start
   takes tens of seconds, so the rule asks again only once the new one is READY and the figures
   still say full. No READY instance, no figures: the rule is then silent.
3. Wanted starts: while instances start, and requests are held or one was refused (its hold
   deadline passed) within `keep_starts_s` (600 s), at least READY + starting: a start someone
   waits on is not cancelled for idleness, so the client's retry finds it on its way or READY.
   (A held request refused at its deadline ended the deployment's last demand, and its idle
   timeout then stopped the engine still starting, a vLLM start that took 180 s of a 120 s hold:
   each retry began again from nothing.) Once READY it idles as any instance does.
4. Bounds: `min_warm` ≤ ready ≤ `max`.
5. Flap suppression, for scale-down only (scale-up is never delayed):
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
6. Sleeping: ready + sleeping ≤ `max` (the sleeping count gives way), and none at all when the
   engine has no sleep mode (`Observation.can_sleep` False: vLLM's CPU build). Then what a policy
   would have put to sleep is stopped, after the long down delay since a start undoes it, instead
   of staying READY while waiting for a sleep that cannot happen.

Which decision uses which signal:

| signal | measured by | decides |
|---|---|---|
| requests in flight and held (the activator's counts) | activator, `Demand.load` | the reactive floor and cold-start fast path (rule 1); the wanted starts (rule 3); reactive's count |
| when a request last left without an instance | `ObservationTracker`, from the activator's events | the wanted starts (rule 3) |
| arrivals and per-second concurrency | `ObservationTracker`, from the activator's events | every policy's desired count: kpa's windows, keepalive's and histogram's per-second needs, predictive's forecast and its service time, S = L_s / λ (the window's concurrency less the time held) |
| idle gaps (out of work → next arrival) | `ObservationTracker` | histogram's and predictive's pre-warm and keep-until points for the last instance |
| requests waiting inside the engines, KV-cache fill | engines' `/metrics`, `engine_signals.EngineScraper` | the saturation rule (rule 2) |
| measured start-up time per tier, and the tier a start would come from | `ObservationTracker.started`; the pool's page-cache probe | predictive's forecast horizon and pre-warm lead; histogram's pre-warm lead |
| can the engine sleep | the engine's reported sleep levels (the pool) | the sleeping target (rule 6); predictive's lead (a start, not a wake) and its stop-or-READY plan |

The wrapped state is `RuledState(inner=<the policy's own state>, ...)`; start from
`RuledState(inner=<its initial state>)`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import Decision, Observation, Policy, ScalingConfig


@dataclass(frozen=True)
class RulesConfig:
    down_delay_s: float = 30.0
    sleep_delay_s: float = 10.0
    down_step_s: float = 2.0
    max_down_rate: float = 2.0
    saturation_waiting: int = 1  # requests waiting inside the READY engines, summed
    saturation_kv_usage: float = 0.9  # the READY engines' mean KV-cache fill, 0..1
    # A start a request was refused for is kept this long after (rule 3): the activator's longest
    # hold (`ActivatorConfig.hold_deadline_max_s`) is the same 600 s.
    keep_starts_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("down_delay_s", "sleep_delay_s", "down_step_s", "keep_starts_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidConfig(name, f"{name} must be a finite number ≥ 0, got {value!r}")
        if not (isinstance(self.max_down_rate, int | float) and self.max_down_rate >= 1):
            raise InvalidConfig("max_down_rate", f"max_down_rate must be ≥ 1, got {self.max_down_rate!r}")
        waiting = self.saturation_waiting
        if not (isinstance(waiting, int) and not isinstance(waiting, bool) and waiting >= 1):
            raise InvalidConfig(
                "saturation_waiting", f"saturation_waiting must be an integer ≥ 1, got {waiting!r}"
            )
        usage = self.saturation_kv_usage
        if not (isinstance(usage, int | float) and 0 < usage <= 1):
            raise InvalidConfig(
                "saturation_kv_usage", f"saturation_kv_usage must be in (0, 1], got {usage!r}"
            )


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
    if o.ready > 0 and ready <= o.ready and (why := _saturated(o, rules)):
        ready, reason = o.ready + 1, f"saturated: {why}: {o.ready} READY + 1"
    if o.starting and ready < o.ready + o.starting and _waited_on(o, rules, now):
        ready = o.ready + o.starting
        reason = f"keeping {o.starting} start(s) requests wait on ({reason})"
    if ready < c.min_warm:
        ready, reason = c.min_warm, f"min_warm {c.min_warm}"
    if ready > c.max:
        ready, reason = c.max, f"capped at max {c.max}: {reason}"

    # Without sleep mode nothing is put to sleep: the surplus is stopped, and the long delay holds.
    wanted_sleeping = max(decision.sleeping, 0) if o.can_sleep else 0
    prev = state.last_ready
    if ready < prev:
        lowest = max(ready, math.floor(prev / rules.max_down_rate))
        to_sleep = wanted_sleeping >= o.sleeping + (prev - ready)  # every one leaving READY sleeps
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

    sleeping = min(wanted_sleeping, c.max - ready)
    last_up = now if ready > prev else state.last_up
    last_down = now if ready < prev else state.last_down
    out = Decision(ready, sleeping, decision.warm, reason, decision.forecast, decision.adapters)
    return out, RuledState(inner, ready, last_up, last_down)


def _waited_on(o: Observation, rules: RulesConfig, now: float) -> bool:
    """Whether requests wait on the starts in flight: held now, or one refused lately (rule 3)."""
    return o.queued > 0 or (o.refused_at is not None and now - o.refused_at <= rules.keep_starts_s)


def _saturated(o: Observation, rules: RulesConfig) -> str:
    """Why the READY engines are full ("" if they are not)."""
    if o.engine_waiting >= rules.saturation_waiting:
        return f"{o.engine_waiting} waiting inside the engines"
    if o.kv_cache_usage is not None and o.kv_cache_usage >= rules.saturation_kv_usage:
        return f"KV cache {o.kv_cache_usage:.0%} full"
    return ""


def with_rules(
    policy: Policy, scaling: ScalingConfig, rules: RulesConfig | None = None
) -> Policy[RuledState]:
    """`policy` held to the shared rules; its state is a `RuledState` wrapping the policy's own."""
    return functools.partial(ruled, policy=policy, scaling=scaling, rules=rules or RulesConfig())
