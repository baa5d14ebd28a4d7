"""The autoscaling policies by name, each held to the shared rules: `make_policy(name, scaling)`.

| name | what it is | sleeps? |
|---|---|---|
| `predictive` (default) | damped Holt forecast at the start-up horizon, Little's law, idle-gap histogram, sleeping tier | yes, if the engine can |
| `kpa` | Knative's KPA: 60 s stable / 6 s panic windows, 200 % panic threshold, 70 % target utilization | no |
| `keepalive` | every instance kept 600 s after the last second that needed it | no |
| `histogram` | Shahrad et al.'s hybrid histogram: pre-warm at the 5th, keep until the 99th percentile of idle gaps | no |
| `reactive` | the pool's original policy (`warm_pool.policies.reactive`) | no |

Each is a pure function `(observation, state, now, config) -> (decision, state)`. `make_policy`
binds the config with `functools.partial`, wraps the result in `rules.with_rules` and hands back the
initial state with it; `target_concurrency` and `max` come from the deployment's `ScalingConfig`
(and kpa's stable window from its `stable_window_s`), anything else from keyword overrides. An
engine without sleep mode (`Observation.can_sleep` False) gets no SLEEPING from any of them: the
shared rules see to it (`rules.py`, rule 6), and predictive plans stops and starts instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import Policy, ScalingConfig
from warm_pool.policies.histogram import HistogramPolicyConfig, HistogramState, histogram
from warm_pool.policies.keepalive import KeepaliveConfig, KeepaliveState, keepalive
from warm_pool.policies.kpa import KpaConfig, KpaState, kpa
from warm_pool.policies.predictive import PredictiveConfig, PredictiveState, predictive
from warm_pool.policies.reactive import PolicyState, reactive
from warm_pool.policies.rules import RuledState, RulesConfig, with_rules

DEFAULT_POLICY = "predictive"


@dataclass(frozen=True)
class PolicyKind:
    function: Callable[..., Any]  # (observation, state, now, config) -> (decision, state)
    config: type  # its config dataclass
    state: type  # its state dataclass; `state()` is the initial state


POLICIES: dict[str, PolicyKind] = {
    "predictive": PolicyKind(predictive, PredictiveConfig, PredictiveState),
    "kpa": PolicyKind(kpa, KpaConfig, KpaState),
    "keepalive": PolicyKind(keepalive, KeepaliveConfig, KeepaliveState),
    "histogram": PolicyKind(histogram, HistogramPolicyConfig, HistogramState),
    "reactive": PolicyKind(reactive, ScalingConfig, PolicyState),
}


@dataclass(frozen=True)
class BoundPolicy:
    """A policy ready for the loop: `decision, state = bound.decide(observation, state, now)`."""

    name: str
    decide: Policy[RuledState]
    initial_state: RuledState
    config: Any


def policy_config(name: str, scaling: ScalingConfig, **overrides: Any) -> Any:
    """The named policy's config: the deployment's scaling settings plus `overrides`."""
    kind = _kind(name)
    if kind.config is ScalingConfig:
        base: dict[str, Any] = {}
    else:
        base = {"target_concurrency": scaling.target_concurrency, "max": scaling.max}
        if kind.config is KpaConfig:
            base["stable_window_s"] = scaling.stable_window_s
    fields = {f.name for f in dataclasses.fields(kind.config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise InvalidConfig(
            unknown[0], f"policy {name} has no setting {unknown[0]!r}; it has: {', '.join(sorted(fields))}"
        )
    try:
        if kind.config is ScalingConfig:
            return dataclasses.replace(scaling, **overrides)
        return kind.config(**{**base, **overrides})
    except TypeError as exc:  # a value of the wrong type deep in a comparison
        raise InvalidConfig(name, f"policy {name}: bad setting: {exc}") from None


def make_policy(
    name: str, scaling: ScalingConfig, rules: RulesConfig | None = None, **overrides: Any
) -> BoundPolicy:
    """The named policy, configured and held to the shared rules; an unknown name lists the known."""
    kind = _kind(name)
    config = policy_config(name, scaling, **overrides)
    inner = functools.partial(kind.function, config=config)
    return BoundPolicy(name, with_rules(inner, scaling, rules), RuledState(inner=kind.state()), config)


def _kind(name: str) -> PolicyKind:
    kind = POLICIES.get(name)
    if kind is None:
        raise InvalidConfig("policy", f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return kind
