"""The warm pool's Prometheus metrics, registered on a registry the composition root hands in.

Instance-seconds are the base of cost accounting: the pool adds the seconds each instance spent in
each state on every transition and every tick (`Instance.accrue` / `Instance.move_to`), so
`sum by (deployment) (rate(stoker_instance_seconds_total{state!="STOPPED"}[1h]))` is instances held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from warm_pool.states import InstanceState

COLD_START_PHASES = ("snapshot_local", "process_start", "model_load", "total_to_ready")
COLD_START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
START_OUTCOMES = ("ready", "failed")


def split_cold_start(
    snapshot_local_s: float, spawn_to_ready_s: float, engine_phases: Mapping[str, float]
) -> dict[str, float]:
    """Cold-start phases from what the pool timed and what the engine reported.

    model_load is the engine's weight_load + warm_up; process_start is the rest of spawn→ready
    (interpreter, imports, binding the port, the health poll's granularity). E.g. snapshot 0.2 s,
    spawn→ready 9.0 s, engine weight_load 2.5 s + warm_up 0.5 s → process_start 6.0, model_load 3.0,
    total_to_ready 9.2. Without engine phases (vLLM) all of spawn→ready counts as model_load.
    """
    if "weight_load" in engine_phases:
        model_load = engine_phases["weight_load"] + engine_phases.get("warm_up", 0.0)
        model_load = min(model_load, spawn_to_ready_s)
    else:
        model_load = spawn_to_ready_s
    return {
        "snapshot_local": snapshot_local_s,
        "process_start": spawn_to_ready_s - model_load,
        "model_load": model_load,
        "total_to_ready": snapshot_local_s + spawn_to_ready_s,
    }


class PoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.instances = Gauge(
            "stoker_instances",
            "Instances by deployment and state.",
            ["deployment", "state"],
            registry=registry,
        )
        self.instance_seconds = Counter(
            "stoker_instance_seconds",
            "Seconds instances spent in each state (cost accounting).",
            ["deployment", "state"],
            registry=registry,
        )
        self.cold_start = Histogram(
            "stoker_cold_start_seconds",
            "Instance start time by phase: snapshot_local, process_start, model_load, total_to_ready.",
            ["deployment", "phase"],
            buckets=COLD_START_BUCKETS,
            registry=registry,
        )
        self.starts = Counter(
            "stoker_instance_starts",
            "Instance starts by outcome (ready, failed).",
            ["deployment", "outcome"],
            registry=registry,
        )
        self.restarts = Counter(
            "stoker_instance_restarts",
            "Instances started to replace a failed one.",
            ["deployment"],
            registry=registry,
        )

    def set_instances(self, deployment: str, counts: Mapping[InstanceState, int]) -> None:
        """Every state's count for the deployment, zeros included, so a state left shows 0."""
        for state in InstanceState:
            self.instances.labels(deployment, state.value).set(counts.get(state, 0))

    def add_instance_seconds(self, deployment: str, state: InstanceState, seconds: float) -> None:
        if seconds > 0:
            self.instance_seconds.labels(deployment, state.value).inc(seconds)

    def observe_cold_start(self, deployment: str, phases: Mapping[str, float]) -> None:
        for phase, seconds in phases.items():
            if phase not in COLD_START_PHASES:
                raise ValueError(f"cold-start phase must be one of {COLD_START_PHASES}, got {phase!r}")
            self.cold_start.labels(deployment, phase).observe(max(0.0, seconds))

    def start_finished(self, deployment: str, outcome: str) -> None:
        if outcome not in START_OUTCOMES:
            raise ValueError(f"start outcome must be one of {START_OUTCOMES}, got {outcome!r}")
        self.starts.labels(deployment, outcome).inc()

    def restarted(self, deployment: str) -> None:
        self.restarts.labels(deployment).inc()

    def forget(self, deployment: str) -> None:
        """Drop a removed deployment's gauges (its counters stay: they are history)."""
        for state in InstanceState:
            with contextlib.suppress(KeyError):
                self.instances.remove(deployment, state.value)
