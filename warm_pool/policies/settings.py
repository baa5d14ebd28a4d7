"""How a deployment's own settings configure the policy it runs: `bind_policy(name, scaling)`.

A deployment says, in its own terms, how long to wait before scaling down (`stable_window_s`, the
platform's `--stable-window`, at most the idle timeout) and how long an idle deployment keeps any
instance at all (`idle_timeout_s`, `stoker deploy --idle-timeout`). Each policy has its own names
for these; this is the one table that maps them, so the live pool and a simulation of it (the
live-equals-simulated test) bind a policy the same way:

| setting | kpa | keepalive | histogram | predictive | shared rules |
|---|---|---|---|---|---|
| stable window w | stable window (at least 6 s, Knative's floor) | — | load window | READY while the idle-gap histogram is not representative | down delay min(30, w), sleep delay min(10, w), step min(2, w) |
| idle timeout | — (to zero after a stable window) | keep-alive | keep-alive fallback | stop a sleeping instance | — |

With the defaults (w = 60 s, idle timeout 300 s) the rules keep their own defaults (30 s, 10 s, 2 s);
a short window, as tests use, shortens them too, so that a scale-down can happen within seconds.
The start-up priors per engine are where the measured averages start from (`ObservationTracker`).
"""

from __future__ import annotations

from typing import Any

from warm_pool.policies import BoundPolicy, make_policy
from warm_pool.policies.base import ScalingConfig, TierTimes
from warm_pool.policies.rules import RulesConfig
from warm_pool.profiles import CPU, GPU, VLLM_CPU

KPA_MIN_WINDOW_S = 6.0  # KpaConfig's lower bound (Knative's own)

# Keyed by engine; "vllm-cpu" is vLLM's CPU build (the pool tells it by the version vLLM reports).
STARTUP_PRIORS: dict[str, TierTimes] = {"cpu": CPU.startup, "vllm": GPU.startup, "vllm-cpu": VLLM_CPU.startup}


def bind_policy(name: str, scaling: ScalingConfig) -> BoundPolicy:
    """The named policy configured from the deployment's settings; `InvalidConfig` for an unknown name."""
    w, idle = scaling.stable_window_s, scaling.idle_timeout_s
    rules = RulesConfig(down_delay_s=min(30.0, w), sleep_delay_s=min(10.0, w), down_step_s=min(2.0, w))
    overrides: dict[str, dict[str, Any]] = {
        "kpa": {"stable_window_s": max(KPA_MIN_WINDOW_S, w)},
        "keepalive": {"keepalive_s": idle},
        "histogram": {"keepalive_s": idle, "window_s": w},
        "predictive": {"fallback_ready_s": w, "sleep_keepalive_s": idle},
    }
    return make_policy(name, scaling, rules, **overrides.get(name, {}))


def startup_priors(engine: str) -> TierTimes:
    return STARTUP_PRIORS.get(engine, TierTimes())
