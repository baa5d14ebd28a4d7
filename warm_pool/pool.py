"""The pool of one deployment: a thin loop around the pure scaling policy.

Every second, and at once when poked (a request arrived with nothing to serve it), the loop
observes (requests in flight and held, from the activator; instances by state), asks the policy
how many instances to have, and applies the answer: it starts instances (PENDING → STARTING →
READY), or drains the surplus (READY → DRAINING → STOPPED: out of the routing set first, in-flight
requests get the grace period, then SIGTERM, then SIGKILL). An instance whose process dies becomes
FAILED and is replaced after an exponential backoff. The pool is the activator's `InstanceSource`;
it tells the activator through `Demand.capacity_changed` whenever its routing set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from warm_pool.backoff import restart_delay
from warm_pool.errors import PoolError, StartFailed
from warm_pool.launch import GpuInventory, LaunchSpec, cpu_engine_spec, vllm_spec
from warm_pool.local import ProcessHandle, free_port
from warm_pool.metrics import PoolMetrics, split_cold_start
from warm_pool.policy import Decision, Observation, Policy, PolicyState, ScalingConfig, reactive
from warm_pool.records import InstanceRecord, InstanceRecords
from warm_pool.states import Instance, InstanceState, new_instance_id

log = logging.getLogger("stoker.pool")

S = InstanceState
COMING_UP = (S.PENDING, S.STARTING)


class LoadView(Protocol):
    in_flight: int
    queued: int
    last_arrival: float | None
    outstanding: Mapping[str, int]


class Demand(Protocol):
    """What the pool needs to know about load, and whom it tells that capacity changed."""

    def load(self) -> LoadView: ...

    def capacity_changed(self) -> None: ...


class Backend(Protocol):
    """Where instances run: local processes now, Kubernetes pods later."""

    async def start(self, instance_id: str, spec: LaunchSpec) -> ProcessHandle: ...

    def is_alive(self, handle: ProcessHandle) -> bool: ...

    async def wait_ready(
        self, handle: ProcessHandle, url: str, timeout_s: float, interval_s: float = 0.1, *, health_path: str
    ) -> None: ...

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None: ...

    async def read_startup_phases(self, url: str) -> dict[str, float]: ...


@dataclass(frozen=True)
class PoolSpec:
    deployment: str
    snapshot_dir: Path
    engine: str = "cpu"  # "cpu" | "vllm"
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    grace_period_s: float = 30.0  # in-flight requests of a draining instance get this long
    instance_concurrency: int = 8  # requests one instance takes at once (the engine's --max-num-seqs)
    start_timeout_s: float = 300.0
    kill_timeout_s: float = 10.0  # after SIGTERM, before SIGKILL
    host: str = "127.0.0.1"
    threads: int | None = None


class Pool:
    def __init__(
        self,
        spec: PoolSpec,
        backend: Backend,
        records: InstanceRecords,
        metrics: PoolMetrics,
        *,
        gpus: GpuInventory | None = None,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 1.0,
    ) -> None:
        self.spec = spec
        self._backend = backend
        self._records = records
        self._metrics = metrics
        self._gpus = gpus or GpuInventory([])
        self._clock = clock
        self._tick_s = tick_s
        self._policy: Policy = functools.partial(reactive, config=spec.scaling)
        self._policy_state = PolicyState.initial()
        self._demand: Demand | None = None
        self._instances: dict[str, Instance] = {}
        self._handles: dict[str, ProcessHandle] = {}
        self._launches: dict[str, asyncio.Task] = {}  # starts in progress, cancellable
        self._stops: dict[str, asyncio.Task] = {}  # drains and stops in progress, never cancelled
        self._wake = asyncio.Event()
        self._closing = False
        self._failures = 0  # consecutive failed starts, for the restart backoff
        self._not_before = 0.0  # no new start before this time (backoff after a failure)
        self.last_decision: Decision | None = None

    # ---- the activator's InstanceSource -------------------------------------------------------------

    def endpoints(self) -> list[Instance]:
        return [i for i in self._instances.values() if i.state == S.READY]

    def poke(self) -> None:
        self._wake.set()

    def report_failure(self, endpoint_id: str) -> None:
        log.warning("instance %s failed a request; checking it", endpoint_id)
        self._wake.set()

    # ---- wiring and control ---------------------------------------------------------------------------

    def attach(self, demand: Demand) -> None:
        self._demand = demand

    def update_scaling(self, scaling: ScalingConfig) -> None:
        self.spec = replace(self.spec, scaling=scaling)
        self._policy = functools.partial(reactive, config=scaling)
        self._wake.set()

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in S}
        for inst in self._instances.values():
            counts[inst.state.value] += 1
        return counts

    async def run(self) -> None:
        """The control loop; returns when `close` is called."""
        if self._demand is None:
            raise PoolError(f"pool {self.spec.deployment} has no demand attached")
        while not self._closing:
            try:
                self._tick()
            except Exception:  # one bad tick must not end the deployment's loop
                log.exception("pool %s: tick failed", self.spec.deployment)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._tick_s):
                    await self._wake.wait()
            self._wake.clear()

    async def close(self, drain: bool = True) -> None:
        """Stop the loop and every instance: draining (grace period) or at once."""
        self._closing = True
        self._wake.set()
        for task in list(self._launches.values()):
            task.cancel()
        await asyncio.gather(*self._launches.values(), *self._stops.values(), return_exceptions=True)
        grace = self.spec.grace_period_s if drain else 0.0
        await asyncio.gather(
            *(self._drain(i, grace) for i in list(self._instances.values()) if i.state != S.STOPPED),
            return_exceptions=True,
        )
        self._account(self._clock())

    # ---- one tick: observe, decide, apply ----------------------------------------------------------

    def _tick(self) -> None:
        now = self._clock()
        self._reap_dead(now)
        load = self._demand.load()
        ready = sum(1 for i in self._instances.values() if i.state == S.READY)
        coming = [i for i in self._instances.values() if i.state in COMING_UP]
        observation = Observation(load.in_flight, load.queued, ready, len(coming), load.last_arrival)
        decision, self._policy_state = self._policy(observation, self._policy_state, now)
        self.last_decision = decision
        active = ready + len(coming)
        if decision.desired > active:
            if now >= self._not_before:
                for _ in range(decision.desired - active):
                    self._start_instance(now)
        elif decision.desired < active:
            self._shed(active - decision.desired, coming, load.outstanding)
        self._account(now)

    def _start_instance(self, now: float) -> None:
        inst = Instance(
            id=new_instance_id(self.spec.deployment),
            deployment=self.spec.deployment,
            created_at=now,
            max_concurrency=self.spec.instance_concurrency,
            host=self.spec.host,
        )
        self._instances[inst.id] = inst
        self._spawn(self._launches, inst, self._launch(inst))

    def _shed(self, surplus: int, coming: list[Instance], outstanding: Mapping[str, int]) -> None:
        """Cancel starts first (newest first), then drain the least busy READY instances."""
        for inst in sorted(coming, key=lambda i: i.created_at, reverse=True)[:surplus]:
            if (task := self._launches.get(inst.id)) is not None:
                task.cancel()
            surplus -= 1
        ready = [i for i in self._instances.values() if i.state == S.READY]
        for inst in sorted(ready, key=lambda i: (outstanding.get(i.id, 0), -i.created_at))[:surplus]:
            self._spawn(self._stops, inst, self._drain(inst, self.spec.grace_period_s))

    def _reap_dead(self, now: float) -> None:
        """READY instances whose process is gone become FAILED and leave the routing set."""
        for inst in list(self._instances.values()):
            handle = self._handles.get(inst.id)
            if inst.state == S.READY and handle is not None and not self._backend.is_alive(handle):
                log.warning("instance %s (pid %s) died", inst.id, handle.pid)
                self._move(inst, S.FAILED, now)
                self._failed_start(now)
                self._demand.capacity_changed()
                self._spawn(self._stops, inst, self._forget(inst, to=S.STOPPED))

    # ---- instance lifecycles -------------------------------------------------------------------------

    async def _launch(self, inst: Instance) -> None:
        spec, clock = self.spec, self._clock
        t0 = clock()
        try:
            snapshot_dir = self._snapshot_local()
            snapshot_s = clock() - t0
            inst.port = free_port(spec.host)
            launch = self._launch_spec(inst, snapshot_dir)
            self._move(inst, S.STARTING, clock())
            handle = await self._backend.start(inst.id, launch)
            self._handles[inst.id], inst.pid = handle, handle.pid
            self._records.put(
                InstanceRecord(
                    inst.id,
                    spec.deployment,
                    handle.pid,
                    handle.pgid,
                    handle.start_ticks,
                    inst.port,
                    inst.url,
                    time.time(),
                )
            )
            t1 = clock()
            await self._backend.wait_ready(
                handle, inst.url, spec.start_timeout_s, health_path=launch.health_path
            )
            t2 = clock()
            phases = await self._backend.read_startup_phases(inst.url)
        except (StartFailed, PoolError, OSError) as exc:
            log.error("instance %s failed to start: %s", inst.id, exc)
            self._metrics.start_finished(spec.deployment, "failed")
            self._move(inst, S.FAILED, clock())
            self._failed_start(clock())
            await self._forget(inst, to=S.STOPPED)
            return
        except asyncio.CancelledError:
            await self._forget(inst, to=S.STOPPED)
            raise
        self._metrics.observe_cold_start(spec.deployment, split_cold_start(snapshot_s, t2 - t1, phases))
        self._metrics.start_finished(spec.deployment, "ready")
        self._move(inst, S.READY, clock())
        self._failures = 0
        log.info("instance %s ready at %s after %.2fs", inst.id, inst.url, t2 - t0)
        self._demand.capacity_changed()

    def _snapshot_local(self) -> Path:
        # The snapshot is already in the local store; fetching it from object storage comes later.
        if not self.spec.snapshot_dir.is_dir():
            raise PoolError(f"snapshot directory {self.spec.snapshot_dir} is missing")
        return self.spec.snapshot_dir

    def _launch_spec(self, inst: Instance, snapshot_dir: Path) -> LaunchSpec:
        spec = self.spec
        if spec.engine == "vllm":
            gpus = self._gpus.acquire(1, inst.id)
            return vllm_spec(snapshot_dir, inst.port, spec.deployment, gpus, host=spec.host)
        extra = (
            "--max-num-seqs",
            str(spec.instance_concurrency),
            "--grace-period",
            f"{spec.grace_period_s:g}",
        )
        return cpu_engine_spec(
            snapshot_dir, inst.port, spec.deployment, host=spec.host, threads=spec.threads, extra_args=extra
        )

    async def _drain(self, inst: Instance, grace_s: float) -> None:
        """Out of the routing set, let in-flight requests finish within `grace_s`, then stop."""
        if inst.state == S.READY:
            self._move(inst, S.DRAINING, self._clock())
            self._demand.capacity_changed()
            deadline = self._clock() + grace_s
            # A bounded poll of the activator's counter: 50 ms of latency on a drain costs nothing.
            while self._demand.load().outstanding.get(inst.id, 0) > 0 and self._clock() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await self._forget(inst, to=S.STOPPED)

    async def _forget(self, inst: Instance, to: InstanceState | None = None) -> None:
        """Stop the instance's process (SIGTERM, then SIGKILL) and drop it from the pool."""
        handle = self._handles.pop(inst.id, None)
        if handle is not None:
            # The engine drains on SIGTERM too; give it the grace period before the SIGKILL.
            term = self.spec.grace_period_s + self.spec.kill_timeout_s
            await asyncio.shield(self._backend.stop(handle, term))
        self._records.remove(inst.id)
        self._gpus.release(inst.id)
        if to is not None and inst.state != to:
            self._move(inst, to, self._clock())
        self._instances.pop(inst.id, None)
        self._account(self._clock())

    def _spawn(self, tasks: dict[str, asyncio.Task], inst: Instance, work) -> None:
        task = asyncio.create_task(work, name=f"{work.__name__}-{inst.id}")
        tasks[inst.id] = task
        task.add_done_callback(lambda t: tasks.pop(inst.id, None) if tasks.get(inst.id) is t else None)

    def _failed_start(self, now: float) -> None:
        self._failures += 1
        self._metrics.restarted(self.spec.deployment)
        self._not_before = now + restart_delay(self._failures - 1)
        self._wake.set()

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _move(self, inst: Instance, new: InstanceState, now: float) -> None:
        left, seconds = inst.move_to(new, now)
        self._metrics.add_instance_seconds(self.spec.deployment, left, seconds)
        self._metrics.set_instances(self.spec.deployment, self._state_counts())

    def _account(self, now: float) -> None:
        for inst in self._instances.values():
            state, seconds = inst.accrue(now)
            self._metrics.add_instance_seconds(self.spec.deployment, state, seconds)
        self._metrics.set_instances(self.spec.deployment, self._state_counts())

    def _state_counts(self) -> dict[InstanceState, int]:
        counts = dict.fromkeys(S, 0)
        for inst in self._instances.values():
            counts[inst.state] += 1
        return counts
