"""The warm pool's Prometheus metrics, registered on a registry the composition root hands in.

Instance-seconds are the base of cost accounting: the pool adds the seconds each instance spent in
each state on every transition and every tick (`Instance.accrue` / `Instance.move_to`), so
`sum by (deployment) (rate(stoker_instance_seconds_total{state!="STOPPED"}[1h]))` is instances held.

Start-up is measured per tier (`stoker_instance_startup_seconds{tier}`: from the decision to start or
wake to READY), the same seconds the scaler is fed; cold starts are counted per request and tier
(`stoker_cold_start_requests_total{tier}`: requests served by an instance that became READY after
they arrived), the count the simulator reports as `cold_starts`.

`stoker_instance_state_corrections_total{believed, observed}` counts the times the pool found an
engine's own sleep state other than it believed (`warm_pool.reconcile`): READY but `asleep`,
SLEEPING but `awake`, or `unauthorized` (it holds another key). Any is worth a look: something
other than the pool sleeps or wakes its engines, or their calls time out after doing their work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from warm_pool.states import InstanceState

COLD_START_PHASES = (
    "snapshot_local",
    "process_start",
    "model_load",
    "engine_init",
    "compile",
    "total_to_ready",
)
COLD_START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
START_OUTCOMES = ("ready", "failed")
TIERS = ("wake", "runtime", "page_cache", "disk", "object_storage")  # warm_pool.policies.base.Tier's values
SLEEP_ACTIONS = ("sleep", "wake")
CORRECTED_BELIEFS = ("READY", "SLEEPING")
CORRECTED_OBSERVATIONS = ("asleep", "awake", "unauthorized")  # warm_pool.reconcile.Observed's, less unknown


def split_cold_start(
    snapshot_local_s: float, spawn_to_ready_s: float, engine_phases: Mapping[str, float]
) -> dict[str, float]:
    """Cold-start phases from what the pool timed and what the engine reported.

    The CPU engine reports weight_load and warm_up: model_load is their sum, process_start the rest
    of spawn→ready (interpreter, imports, binding the port, the health poll's granularity). E.g.
    snapshot 0.2 s, spawn→ready 9.0 s, weight_load 2.5 s + warm_up 0.5 s → process_start 6.0,
    model_load 3.0, total_to_ready 9.2.

    vLLM's log gives weights, engine_init (profiling, KV cache, warm-up, torch.compile) and compile
    (part of engine_init): model_load is weights, and engine_init and compile are phases of their
    own; process_start is what is left (imports, engine core and worker processes, the API server).
    E.g. spawn→ready 93 s, weights 1.7, engine_init 60.8 of which compile 54 → process_start 30.5.
    Without engine phases all of spawn→ready counts as model_load.
    """
    extra: dict[str, float] = {}
    if "weight_load" in engine_phases:
        model_load = engine_phases["weight_load"] + engine_phases.get("warm_up", 0.0)
    elif "weights" in engine_phases:
        model_load = engine_phases["weights"]
        extra = {k: engine_phases[k] for k in ("engine_init", "compile") if k in engine_phases}
    else:
        model_load = spawn_to_ready_s
    model_load = min(model_load, spawn_to_ready_s)
    rest = max(0.0, spawn_to_ready_s - model_load - extra.get("engine_init", 0.0))
    return {
        "snapshot_local": snapshot_local_s,
        "process_start": rest,
        "model_load": model_load,
        **extra,
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
            "Instance start time by phase: snapshot_local, process_start, model_load, engine_init and compile (vLLM), total_to_ready.",
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
        self.startup = Histogram(
            "stoker_instance_startup_seconds",
            "Seconds from the decision to start (or wake) an instance to READY, by the tier it came from.",
            ["deployment", "tier"],
            buckets=COLD_START_BUCKETS,
            registry=registry,
        )
        self.cold_requests = Counter(
            "stoker_cold_start_requests",
            "Requests served by an instance that became READY after they arrived, by that instance's tier.",
            ["deployment", "tier"],
            registry=registry,
        )
        self.sleep_wake = Counter(
            "stoker_instance_sleep_wake",
            "Sleep and wake calls to engines, by action (sleep, wake) and outcome (ok, failed).",
            ["deployment", "action", "outcome"],
            registry=registry,
        )
        self.corrections = Counter(
            "stoker_instance_state_corrections",
            "Instances whose engine's own sleep state was not what the pool believed, by belief and observation.",
            ["deployment", "believed", "observed"],
            registry=registry,
        )
        self.desired = Gauge(
            "stoker_scaler_desired_instances",
            "The scaling policy's last answer: instances to keep READY and SLEEPING.",
            ["deployment", "state"],
            registry=registry,
        )
        self.arrivals = Counter(
            "stoker_scaler_arrivals",
            "Requests the scaler heard of on arrival (from the gateways, held ones included): what it forecasts.",
            ["deployment"],
            registry=registry,
        )
        self.recycles = Counter(
            "stoker_instance_recycles",
            "Instances past their maximum age replaced without a dip, by outcome (replaced, called_off, lost, "
            "no_room: waited for device memory).",
            ["deployment", "outcome"],
            registry=registry,
        )
        self.forecast = Gauge(
            "stoker_scaler_forecast_requests_per_second",
            "The arrival rate the scaling policy last planned for (policies that forecast).",
            ["deployment"],
            registry=registry,
        )
        # Each pool's latest counts and decision: a deployment's gauges sum its pools (revisions).
        self._counts: dict[str, dict[InstanceState, int]] = {}
        self._decisions: dict[str, tuple[int, int, float | None]] = {}

    def set_instances(self, pool: str, counts: Mapping[InstanceState, int]) -> None:
        """One pool's count in every state (`pool`: `PoolSpec.key`, "deployment@revision"); the
        gauge is the deployment's, summed over its pools, zeros included so a state left shows 0."""
        self._counts[pool] = dict(counts)
        self._publish_instances(_deployment(pool))

    def _publish_instances(self, deployment: str) -> None:
        mine = [c for p, c in self._counts.items() if _deployment(p) == deployment]
        for state in InstanceState:
            self.instances.labels(deployment, state.value).set(sum(c.get(state, 0) for c in mine))

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

    def observe_startup(self, deployment: str, tier: str, seconds: float) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.startup.labels(deployment, tier).observe(max(0.0, seconds))

    def arrived(self, deployment: str) -> None:
        self.arrivals.labels(deployment).inc()

    def recycled(self, deployment: str, outcome: str) -> None:
        self.recycles.labels(deployment, outcome).inc()

    def cold_request(self, deployment: str, tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.cold_requests.labels(deployment, tier).inc()

    def sleep_wake_finished(self, deployment: str, action: str, ok: bool) -> None:
        if action not in SLEEP_ACTIONS:
            raise ValueError(f"action must be one of {SLEEP_ACTIONS}, got {action!r}")
        self.sleep_wake.labels(deployment, action, "ok" if ok else "failed").inc()

    def state_corrected(self, deployment: str, believed: str, observed: str) -> None:
        if believed not in CORRECTED_BELIEFS or observed not in CORRECTED_OBSERVATIONS:
            raise ValueError(
                f"a correction is one of {CORRECTED_BELIEFS} × {CORRECTED_OBSERVATIONS}, got {believed!r}, {observed!r}"
            )
        self.corrections.labels(deployment, believed, observed).inc()

    def decided(self, pool: str, ready: int, sleeping: int, forecast: float | None) -> None:
        """One pool's latest decision; the gauges are the deployment's, summed over its pools."""
        self._decisions[pool] = (ready, sleeping, forecast)
        self._publish_decisions(_deployment(pool))

    def _publish_decisions(self, deployment: str) -> None:
        mine = [d for p, d in self._decisions.items() if _deployment(p) == deployment]
        self.desired.labels(deployment, "READY").set(sum(d[0] for d in mine))
        self.desired.labels(deployment, "SLEEPING").set(sum(d[1] for d in mine))
        forecasts = [d[2] for d in mine if d[2] is not None]
        if forecasts:
            self.forecast.labels(deployment).set(sum(forecasts))

    def pool_gone(self, pool: str) -> None:
        """A pool stopped while its deployment stays (a revision drained away): its share leaves
        the deployment's gauges."""
        self._counts.pop(pool, None)
        self._decisions.pop(pool, None)
        self._publish_instances(_deployment(pool))
        self._publish_decisions(_deployment(pool))

    def forget(self, deployment: str) -> None:
        """Drop a removed deployment's gauges (its counters stay: they are history)."""
        for pool in [p for p in (*self._counts, *self._decisions) if _deployment(p) == deployment]:
            self._counts.pop(pool, None)
            self._decisions.pop(pool, None)
        for state in InstanceState:
            with contextlib.suppress(KeyError):
                self.instances.remove(deployment, state.value)
        for state in ("READY", "SLEEPING"):
            with contextlib.suppress(KeyError):
                self.desired.remove(deployment, state)
        with contextlib.suppress(KeyError):
            self.forecast.remove(deployment)


def _deployment(pool: str) -> str:
    """The deployment of a pool key ("name@revision"); a bare name is its own."""
    return pool.rsplit("@", 1)[0]
