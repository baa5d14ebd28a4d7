"""How a deployment's own settings configure the policy it runs: `bind_policy(name, scaling)`.

A deployment says, in its own terms, how long to wait before scaling down (`stable_window_s`, the
platform's `--stable-window`, at most the idle timeout) and how long an idle deployment keeps any
instance at all (`idle_timeout_s`, `stoker deploy --idle-timeout`). Each policy has its own names
for these; this is the one table that maps them, so the live pool and a simulation of it (the
live-equals-simulated test) bind a policy the same way:

| setting | kpa | keepalive | histogram | predictive | shared rules |
|---|---|---|---|---|---|
| stable window w | stable window (at least 6 s, Knative's floor) | — | load window | READY while the idle-gap histogram is not representative | down delay min(30, w), sleep delay min(10, w, T/2), step min(2, w) |
| idle timeout T | — (to zero after a stable window) | keep-alive | keep-alive fallback | stop a sleeping instance; READY at most T/2 | — |

With the defaults (w = 60 s, idle timeout 300 s) the rules keep their own defaults (30 s, 10 s, 2 s);
a short window, as tests use, shortens them too, so that a scale-down can happen within seconds.

The sleeping tier survives any idle timeout: predictive keeps an idle instance READY for
min(w, T/2), asleep until T, stopped at T (`predictive.py`, step 3), and the rules' sleep delay
is at most T/2 too, so that it never holds the instance READY past the point where it should
sleep. With `--idle-timeout 20` (w capped to 20 by the platform): READY 0–10 s, asleep 10–20 s,
stopped at 20 s. A deployment whose policy sleeps is refused an idle timeout under
`MIN_SLEEPING_IDLE_S` (2 s): the pool decides once a second, and a sleeping half shorter than one
tick would be skipped (`idle_timeout_error`).
The start-up priors per engine are where the measured averages start from (`ObservationTracker`).
"""

from __future__ import annotations

from typing import Any

from warm_pool.policies import BoundPolicy, make_policy
from warm_pool.policies.base import ScalingConfig, TierTimes
from warm_pool.policies.predictive import READY_SHARE
from warm_pool.policies.rules import RulesConfig
from warm_pool.profiles import CPU, GPU, VLLM_CPU

KPA_MIN_WINDOW_S = 6.0  # KpaConfig's lower bound (Knative's own)
# The shortest idle timeout a policy with a sleeping tier takes: READY for the first half, asleep
# for the second, each at least one of the pool's 1 s decisions long.
MIN_SLEEPING_IDLE_S = 2.0
SLEEPING_POLICIES = frozenset({"predictive"})  # the policies that put idle instances to sleep

# Keyed by engine; "vllm-cpu" is vLLM's CPU build (the pool tells it by the version vLLM reports).
STARTUP_PRIORS: dict[str, TierTimes] = {"cpu": CPU.startup, "vllm": GPU.startup, "vllm-cpu": VLLM_CPU.startup}


def bind_policy(name: str, scaling: ScalingConfig) -> BoundPolicy:
    """The named policy configured from the deployment's settings; `InvalidConfig` for an unknown name."""
    w, idle = scaling.stable_window_s, scaling.idle_timeout_s
    rules = RulesConfig(
        down_delay_s=min(30.0, w), sleep_delay_s=min(10.0, w, idle * READY_SHARE), down_step_s=min(2.0, w)
    )
    overrides: dict[str, dict[str, Any]] = {
        "kpa": {"stable_window_s": max(KPA_MIN_WINDOW_S, w)},
        "keepalive": {"keepalive_s": idle},
        "histogram": {"keepalive_s": idle, "window_s": w},
        "predictive": {"fallback_ready_s": w, "sleep_keepalive_s": idle},
    }
    return make_policy(name, scaling, rules, **overrides.get(name, {}))


def startup_priors(engine: str) -> TierTimes:
    return STARTUP_PRIORS.get(engine, TierTimes())


def idle_timeout_error(policy: str, idle_timeout_s: float) -> str | None:
    """Why a deployment of `policy` cannot have this idle timeout (None: it can): one with a
    sleeping tier needs `MIN_SLEEPING_IDLE_S`, or its instances would go READY → stopped."""
    if policy in SLEEPING_POLICIES and idle_timeout_s < MIN_SLEEPING_IDLE_S:
        return (
            f"idle timeout {idle_timeout_s:g}s is too short for policy {policy}: it sleeps an idle instance "
            f"for the second half of the idle timeout, which needs at least {MIN_SLEEPING_IDLE_S:g}s "
            f"(or choose a policy that does not sleep: reactive, kpa, keepalive, histogram)"
        )
    return None
