"""What every autoscaling policy shares: its inputs, its answer and the start-up tiers.

The `Observation` a policy is handed (built by `warm_pool.tracker.ObservationTracker`, in the live
pool and the simulator alike), the `Decision` it answers (instances to keep READY, to keep SLEEPING,
snapshots to warm into the page cache), the deployment's `ScalingConfig`, the start-up `Tier`s and
their `TierTimes`, and the `Policy` protocol every policy meets. The policies themselves (reactive,
kpa, keepalive, histogram, predictive) live beside this module, each bound to its config with
`functools.partial` by `warm_pool.policies.make_policy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol, TypeVar

from warm_pool.errors import InvalidScalingConfig

# The defaults every policy, the deployment spec (`stoker.spec.deployment`) and the simulator share.
TARGET_CONCURRENCY = 4  # requests in flight per instance the policies aim for
IDLE_TIMEOUT_S = 300.0  # without a request this long, a deployment goes to zero (5 min)


@dataclass(frozen=True)
class ScalingConfig:
    min_warm: int = 0
    max: int = 1
    target_concurrency: int = TARGET_CONCURRENCY
    idle_timeout_s: float = IDLE_TIMEOUT_S
    stable_window_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("min_warm", "max", "target_concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidScalingConfig(name, f"{name} must be an integer, got {value!r}")
        for name in ("idle_timeout_s", "stable_window_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidScalingConfig(name, f"{name} must be a number of seconds, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise InvalidScalingConfig(name, f"{name} must be a finite number > 0, got {value!r}")
        if self.max < 1:
            raise InvalidScalingConfig("max", f"max must be at least 1, got {self.max}")
        if not 0 <= self.min_warm <= self.max:
            raise InvalidScalingConfig(
                "min_warm", f"min_warm must be in 0..max (0..{self.max}), got {self.min_warm}"
            )
        if self.target_concurrency < 1:
            raise InvalidScalingConfig(
                "target_concurrency", f"target_concurrency must be at least 1, got {self.target_concurrency}"
            )


class Tier(StrEnum):
    """Where a new READY instance would come from, fastest first (ARCHITECTURE.md, "Tiers")."""

    WAKE = "wake"  # a SLEEPING instance: weights in host RAM
    RUNTIME = "runtime"  # a warm runtime (imports done, no model) takes the start: weights only
    PAGE_CACHE = "page_cache"  # a fresh process, snapshot files in the OS page cache
    DISK = "disk"  # a fresh process, snapshot on local NVMe
    OBJECT_STORAGE = "object_storage"  # download first, then as DISK


@dataclass(frozen=True)
class TierTimes:
    """Seconds from "go" to READY from each tier: measured from real starts, these are priors.

    The defaults are a GPU-class guess (vLLM serving an 8B bf16 model, 16 GB of weights, on one
    H100-class GPU): a level-1 wake copies 16 GB back over PCIe (~25 GB/s) and re-creates the KV
    cache, ~1 s; a fresh vLLM process spends ~20 s in imports, CUDA init and graph capture with the
    weights already in RAM; local NVMe adds 16 GB at ~2 GB/s = 8 s; object storage adds a download at
    ~0.5 GB/s = 32 s. The CPU engine's measured figures are far smaller (README, "Benchmarks").
    A start through a warm runtime (`warm_pool.runtimes`) skips the process's imports (and on a GPU
    its CUDA context); without a figure of its own it counts as a page-cache start.
    """

    wake: float = 1.0
    page_cache: float = 20.0
    disk: float = 28.0
    object_storage: float = 60.0
    runtime: float = None  # type: ignore[assignment]  # None given: the page-cache figure
    # The adapter tier: a LoRA adapter loaded onto a READY instance of its base (an adapter
    # deployment's own cold start, `activator.adapters`). Not a way to a new READY instance, so not a
    # `Tier`; the predictive policy's lead for loading a forecast adapter ahead of its request.
    # 0.25 s: vLLM's load of a rank-16 adapter on an 8B model is about 0.1-0.5 s (a planning figure).
    adapter: float = 0.25

    def __post_init__(self) -> None:
        if self.runtime is None:
            object.__setattr__(self, "runtime", self.page_cache)

    def of(self, tier: Tier | str) -> float:
        return float(getattr(self, Tier(tier).value))


class SecondSample(NamedTuple):
    """One whole second [start, start + 1) of a deployment's traffic."""

    start: float
    arrivals: int  # requests that arrived in it
    concurrency: float  # time-weighted mean of requests in flight or held in it (Knative's metric)


@dataclass(frozen=True)
class Observation:
    """What a policy sees at one call. The first five fields are all the reactive policy needs;
    the defaults of the rest keep older call sites valid."""

    in_flight: int  # requests being served by instances
    queued: int  # requests held by the activator
    ready: int  # READY instances
    starting: int  # PENDING + STARTING instances
    last_arrival: float | None  # same clock as `now`; None if no request yet
    arrivals: int = 0  # requests that arrived since the previous observation
    seconds: tuple[SecondSample, ...] = ()  # whole seconds completed since the previous observation
    idle_since: float | None = None  # when the deployment last ran out of work; None while busy
    refused_at: float | None = None  # when a request last left without an instance (held, then refused)
    idle_gaps: tuple[float, ...] = ()  # idle gaps (out of work → next arrival) ended since the last call
    sleeping: int = 0  # SLEEPING instances
    waking: int = 0  # instances waking up (SLEEPING → READY)
    latency_s: float | None = None  # mean seconds a served request held an instance; None: none yet
    startup: TierTimes = TierTimes()  # measured seconds to READY from each tier
    start_tier: Tier = Tier.DISK  # where an instance would come from now (WAKE if one is sleeping)
    snapshot_id: str | None = None  # the deployment's snapshot, for `Decision.warm`
    can_sleep: bool = True  # False: the engine has no sleep mode (vLLM's CPU build); never WAKE
    engine_waiting: int = 0  # requests waiting inside the READY instances' engines, summed
    kv_cache_usage: float | None = None  # their KV caches' mean fill, 0..1; None: none reports one
    # Requests for each LoRA adapter served on this deployment since the previous observation:
    # (adapter deployment, first arrival, last arrival), oldest first (`policies.adapter_forecast`).
    adapter_arrivals: tuple[tuple[str, float, float], ...] = ()
    adapter_loads: int = 0  # adapters loaded onto this deployment's instances in the last minute


@dataclass(frozen=True)
class Decision:
    """What a policy wants: `ready` READY (or coming up), `sleeping` SLEEPING, `warm` snapshots
    read into the page cache ahead of a start, `adapters` the LoRA adapter deployments whose next
    request it expects soon, to be loaded onto a READY instance before it arrives (the adapter's own
    pre-warm). `forecast` is the arrival rate (requests/s) the policy planned for, when it
    forecasts; it is there for plots and logs."""

    ready: int
    sleeping: int = 0
    warm: tuple[str, ...] = ()
    reason: str = ""
    forecast: float | None = None
    adapters: tuple[str, ...] = ()

    @property
    def desired(self) -> int:
        """The name the pool loop used before there was a sleeping tier: the READY target."""
        return self.ready


StateT = TypeVar("StateT")


class Policy(Protocol[StateT]):
    """What the pool loop calls each tick; `functools.partial(reactive, config=...)` is one.

    Each policy has its own frozen state type; `Policy` alone means any of them."""

    def __call__(self, observation: Observation, state: StateT, now: float, /) -> tuple[Decision, StateT]: ...
