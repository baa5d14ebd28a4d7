"""A pool's settings (`PoolSpec`) and what it needs to know about load (`Demand`). How it groups its
instances for a decision is `warm_pool.census`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from warm_pool.engine_settings import EngineSettings
from warm_pool.fleet import Footprint
from warm_pool.instances import InstanceSettings
from warm_pool.policies import DEFAULT_POLICY
from warm_pool.policies.base import ScalingConfig
from warm_pool.snapshot import SnapshotSource
from warm_pool.vllm import VllmLaunch


class LoadView(Protocol):
    in_flight: int
    queued: int
    last_arrival: float | None
    outstanding: Mapping[str, int]


class Demand(Protocol):
    """What the pool needs to know about load, and whom it tells that capacity changed."""

    def load(self) -> LoadView: ...

    def capacity_changed(self) -> None: ...

    def set_unavailable(self, reason: str | None) -> None: ...  # no start can succeed (why), or None


@dataclass(frozen=True)
class PoolSpec:
    deployment: str
    snapshot: SnapshotSource  # made local (pulled if need be) and pinned per instance
    engine: str = "cpu"  # "cpu" | "vllm"
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    policy: str = DEFAULT_POLICY  # a name in warm_pool.policies.POLICIES
    grace_period_s: float = 30.0  # in-flight requests of a draining instance get this long
    instance_concurrency: int = 8  # requests one instance takes at once (the engine's --max-num-seqs)
    start_timeout_s: float = 300.0  # also bounds a sleep or a wake
    kill_timeout_s: float = 10.0  # after SIGTERM, before SIGKILL
    reconcile_interval_s: float = 5.0  # how often settled engines are asked whether they sleep
    unavailable_after: int = 3  # failed starts in a row that refuse held requests with the reason; 0: never
    host: str = "127.0.0.1"
    threads: int | None = None
    vllm: VllmLaunch | None = None  # how this machine runs vLLM (engine "vllm" only)
    footprint: Footprint | None = None  # what an instance reserves on a shared device (with a fleet)
    revision: int = 1  # which of the deployment's revisions this pool serves
    max_instance_age_s: float = 0.0  # instances READY longer are replaced (`warm_pool.recycle`); 0: never
    engine_settings: EngineSettings = field(default_factory=EngineSettings)  # devices, vLLM's, a pod's

    @property
    def key(self) -> str:
        """This pool among all pools: a deployment has one per revision that serves or warms."""
        return f"{self.deployment}@{self.revision}"

    def instance_settings(self) -> InstanceSettings:
        return InstanceSettings(
            self.deployment,
            self.snapshot,
            self.engine,
            self.grace_period_s,
            self.instance_concurrency,
            self.start_timeout_s,
            self.kill_timeout_s,
            self.host,
            self.threads,
            self.vllm,
            self.engine_settings,
        )
