"""The pool of one deployment: a thin loop around the deployment's scaling policy.

Every second, and at once when poked (a request arrived with nothing to serve it), the loop
observes, decides and applies, as the simulator does (`warm_pool.simulate`), through the same
`ObservationTracker` and the same policy function:

- observe: the tracker has heard of every request from the activator (arrival; end, with the
  seconds it held an instance) and of every start (its tier and seconds to READY); the pool adds
  requests in flight and held, and its instances by state. Instances on their way to sleep count as
  sleeping, waking ones as waking.
- decide: `bound.decide(observation, state, now)` → `Decision(ready, sleeping, warm)`.
- apply (`warm_pool.plan.plan`, a pure function the simulator carries out too), up: instances on
  their way to sleep that have not slept yet go back into routing; sleeping ones wake (`POST /wake_up`, then back into routing); the rest start (PENDING → STARTING → READY).
  Down: starts are cancelled (newest first), then the least busy READY instances leave routing and,
  once their requests are done (within the grace period), go to sleep (`POST /sleep?level=1`) while
  fewer sleep than asked, or are drained and stopped; sleeping instances beyond what is asked are
  stopped. A snapshot the policy wants warm is read into the page cache in the background.

The engines' own word on their sleep overrides the pool's belief: every `reconcile_interval_s`
(5 s) each settled instance (READY or SLEEPING, no start, sleep, wake or drain of the pool's in
flight) is asked `GET /is_sleeping` in the background, read at a later tick (`warm_pool.reconcile`).
A READY instance found asleep (slept by someone else) leaves routing as SLEEPING, and the policy
wakes or stops it; a SLEEPING one found awake joins routing as READY, and the policy puts it back
to sleep if it is not wanted; one that refuses the instance's key (401) is replaced. No answer is no
news: liveness is the activator's probes' and `_reap_dead`'s.

A failed start, sleep or wake, or a process that dies (READY or SLEEPING), makes the instance FAILED:
it is stopped and replaced after an exponential backoff. A start that fails because the snapshot
is corrupt is not retried: the pool starts nothing more and the activator refuses held and new
requests with that reason (`Demand.set_unavailable`) until the deployment is deployed again. Other
failed starts are retried, and `unavailable_after` of them in a row make the deployment unavailable
with the last one's reason until a start succeeds (`warm_pool.failures`, which also keeps the last
failure of any kind for `stoker describe`). The pool is the activator's `InstanceSource`; it tells
the activator through `Demand.capacity_changed` whenever its routing set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import NamedTuple, Protocol

from cachetools import LRUCache

from snapshots import SnapshotError, WarmReport
from warm_pool import plan
from warm_pool.arbiter import Member, Wish
from warm_pool.backend import Backend, Running
from warm_pool.backoff import restart_delay
from warm_pool.engine_calls import HttpEngines
from warm_pool.engine_signals import EngineScraper, EngineTotals, engine_totals
from warm_pool.errors import PoolError, SnapshotCorrupt, StartFailed
from warm_pool.failures import FailureRecord, StartFailures, record_of
from warm_pool.fleet import Fleet, Footprint
from warm_pool.instances import InstanceOps, InstanceSettings, Launch, unreachable
from warm_pool.launch import GpuInventory
from warm_pool.metrics import PoolMetrics, split_cold_start
from warm_pool.page_tier import PageTier
from warm_pool.policies import DEFAULT_POLICY
from warm_pool.policies.base import Decision, ScalingConfig, Tier
from warm_pool.policies.settings import bind_policy, startup_priors
from warm_pool.reconcile import Correction, Observed, SleepStates, correction
from warm_pool.snapshot import SnapshotSource
from warm_pool.states import Instance, InstanceState, new_instance_id
from warm_pool.tracker import ObservationTracker
from warm_pool.vllm import VllmLaunch

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
        )


class Phase(StrEnum):
    """Where an instance is in a sleep or wake; it is out of the routing set throughout."""

    TO_SLEEP = "to_sleep"  # READY, waiting for its requests to finish; may still be taken back
    FALLING_ASLEEP = "falling_asleep"  # READY, `POST /sleep` in flight
    WAKING = "waking"  # SLEEPING, `POST /wake_up` in flight


class Census(NamedTuple):
    """The instances as a decision sees them, each in exactly one group (DRAINING/FAILED in none)."""

    routing: list[Instance]  # READY and taking requests
    coming: list[Instance]  # PENDING or STARTING
    waking: list[Instance]
    asleep: list[Instance]  # SLEEPING, nothing in progress
    to_sleep: list[Instance]
    falling: list[Instance]

    @property
    def sleeping(self) -> int:
        """Asleep or on the way: what the observation and the decision call sleeping."""
        return len(self.asleep) + len(self.to_sleep) + len(self.falling)


class Pool:
    def __init__(
        self,
        spec: PoolSpec,
        backend: Backend,
        metrics: PoolMetrics,
        *,
        gpus: GpuInventory | None = None,
        engines: HttpEngines | None = None,  # tests give engines that need no HTTP
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 1.0,
        fleet: Fleet | None = None,  # devices shared with other deployments' pools
    ) -> None:
        self._ops = InstanceOps(spec.instance_settings(), backend, engines=engines, gpus=gpus, clock=clock)
        self.spec = spec
        self.name = spec.deployment
        self._metrics = metrics
        self._clock = clock
        self._fleet = fleet if spec.footprint is not None else None
        self._wish: Wish | None = None  # the latest, for the fleet's arbiter
        self._last_grant = ""  # how the fleet last changed a decision, as logged
        self._outstanding: Mapping[str, int] = {}
        self._tick_s = tick_s
        self._bound = bind_policy(spec.policy, spec.scaling)
        self._policy_state = self._bound.initial_state
        cpu_vllm = spec.engine == "vllm" and spec.vllm is not None and spec.vllm.runtime.cpu_build
        self._tracker = ObservationTracker(startup_priors("vllm-cpu" if cpu_vllm else spec.engine))
        self._demand: Demand | None = None
        self._instances: dict[str, Instance] = {}
        self._phases: dict[str, Phase] = {}  # instances in the middle of a sleep or a wake
        # Where each instance's latest READY came from, for counting cold starts by tier. Bounded:
        # a request can only outlive its instance by the grace period, so 256 is plenty.
        self._tiers: LRUCache[str, Tier] = LRUCache(maxsize=256)
        self._launches: dict[str, asyncio.Task] = {}  # starts in progress, cancellable
        self._turns: dict[str, asyncio.Task] = {}  # sleeps and wakes in progress, cancellable
        self._stops: dict[str, asyncio.Task] = {}  # drains and stops in progress, never cancelled
        self._wake = asyncio.Event()
        self._closing = False
        self._failures = 0  # consecutive failed starts, for the restart backoff
        self._not_before = 0.0  # no new start before this time (backoff after a failure)
        self._corrupt: str | None = None  # set when a start found the snapshot corrupt: no more starts
        # The last failure of any instance, and failed starts in a row (`warm_pool.failures`).
        self._start_failures = StartFailures(spec.unavailable_after)
        self.last_decision: Decision | None = None
        self._page = PageTier(spec.deployment, spec.snapshot)  # the snapshot in the page cache
        # False once an engine reports no sleep levels (vLLM's CPU build): then nothing is put to sleep.
        self.can_sleep: bool = True
        # The READY engines' own queue and KV-cache figures, for the rules' saturation rule: read in
        # the background (`_engine_totals`), each engine at most every 5 s of this pool's clock.
        self._engines = EngineScraper(clock)
        self._scrape: asyncio.Task | None = None
        # What the settled engines say of their sleep, asked in the background (`_reconcile`).
        self._sleep_states = SleepStates(clock, interval_s=spec.reconcile_interval_s, name=spec.deployment)
        if self._fleet is not None:
            self._fleet.register(self)
            devices = self._fleet.devices
            self._ops.share_of = lambda d: (
                spec.footprint.awake / devices.memory(d) if devices.memory(d) else None
            )

    @property
    def spec(self) -> PoolSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: PoolSpec) -> None:
        self._spec = spec
        self._ops.settings = spec.instance_settings()

    # ---- the activator's InstanceSource -------------------------------------------------------------

    def endpoints(self) -> list[Instance]:
        return [i for i in self._instances.values() if i.state == S.READY and i.id not in self._phases]

    def engines(self) -> list[Instance]:
        """Every instance whose engine serves HTTP now: READY (routing or not), SLEEPING, DRAINING.
        For reading them (their metrics), never for routing: that is `endpoints`."""
        return [i for i in self._instances.values() if i.state in (S.READY, S.SLEEPING, S.DRAINING)]

    def poke(self) -> None:
        self._wake.set()

    def report_failure(self, endpoint_id: str) -> None:
        log.warning("instance %s failed a request; checking it", endpoint_id)
        self._wake.set()

    def report_unhealthy(self, endpoint_id: str, reason: str) -> None:
        """The activator's probe says the engine is failed: replaced, as a dead process is. Ignored
        unless it is still in the routing set (one on its way to sleep or out may answer 503)."""
        inst = self._instances.get(endpoint_id)
        if inst is None or inst.state != S.READY or inst.id in self._phases:
            return
        if (task := self._turns.pop(inst.id, None)) is not None:
            task.cancel()
        self._failed(inst, reason, "health")
        self._wake.set()

    def request_arrived(self) -> None:
        self._tracker.arrived(self._clock())

    def request_finished(self, service_s: float | None, cold_on: str | None) -> None:
        self._tracker.finished(self._clock(), service_s)
        if cold_on is not None:
            tier = self._tiers.get(cold_on)
            if tier is None:  # practically never: 256 newer instances came up meanwhile
                log.warning("cold start on %s, whose tier is forgotten; not counted", cold_on)
            else:
                self._metrics.cold_request(self.spec.deployment, tier.value)

    # ---- wiring and control ---------------------------------------------------------------------------

    def attach(self, demand: Demand) -> None:
        self._demand = demand

    def reconfigure(self, scaling: ScalingConfig, policy: str) -> None:
        """New settings take effect at the next tick (now). Another policy starts from its initial
        state; the same one keeps what it learned."""
        bound = bind_policy(policy, scaling)
        if bound.name != self._bound.name:
            self._policy_state = bound.initial_state
        self._bound = bound
        self.spec = replace(self.spec, scaling=scaling, policy=policy)
        lifted = self._start_failures.lift()  # deployed again: held requests wait for one more try
        if self._corrupt is not None or lifted:  # the snapshot gets one more start to check out
            self._corrupt = None
            if self._demand is not None:
                self._demand.set_unavailable(None)
        self._wake.set()

    @property
    def policy(self) -> str:
        return self._bound.name

    @property
    def unavailable(self) -> str | None:
        """Why no instance can start: a corrupt snapshot (until the deployment is deployed again), or
        `unavailable_after` failed starts in a row (until one succeeds)."""
        return self._corrupt or self._start_failures.unavailable

    @property
    def last_failure(self) -> FailureRecord | None:
        return self._start_failures.last

    @property
    def failed_starts(self) -> int:
        """Failed starts since the last one that reached READY."""
        return self._start_failures.in_a_row

    def instances(self) -> list[dict]:
        """Each instance as an operator sees it; `since` is when it entered its state (epoch s)."""
        now, wall = self._clock(), time.time()
        return [
            {
                "id": i.id,
                "state": i.state.value,
                "phase": self._phases.get(i.id),
                "url": i.url if i.port is not None or i.address is not None else None,
                "runs_as": self._ops.handle_name(i),  # "pid 4242", "pod ns/name": where to look
                "device": i.device,
                "reserved_bytes": self._reserved(i),
                "since": wall - (now - i.state_since),
            }
            for i in sorted(self._instances.values(), key=lambda i: i.created_at)
        ]

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in S}
        for inst in self._instances.values():
            counts[inst.state.value] += 1
        return counts

    async def warm_snapshot(self) -> WarmReport:
        """Read the snapshot's files into the page cache (the page-cache tier): `PageTier.warm`."""
        return await self._page.warm()

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

    async def close(self, drain: bool = True, *, stop_instances: bool = True) -> None:
        """Stop the loop and every instance, sleeping ones too: draining (grace period) or at once.
        Without `stop_instances`, the READY and SLEEPING ones run on, for the next controller to
        adopt (starts in progress are still stopped: nothing records them as whole)."""
        self._closing = True
        self._wake.set()
        scrape = [self._scrape] if self._scrape is not None else []
        for task in [*self._launches.values(), *self._turns.values(), *scrape]:
            task.cancel()
        await asyncio.gather(
            *self._launches.values(),
            *self._turns.values(),
            *self._stops.values(),
            *scrape,
            return_exceptions=True,
        )
        self._scrape = None
        if self._fleet is not None:
            self._fleet.forget(self.name)
        await self._page.close()
        await self._engines.aclose()
        await self._sleep_states.aclose()
        await self._ops.close()
        self._phases.clear()
        if not stop_instances:
            self._account(self._clock())
            return
        grace = self.spec.grace_period_s if drain else 0.0
        live = [i for i in self._instances.values() if i.state != S.STOPPED]
        if live:
            log.info("pool %s: stopping %d instance(s), %gs of grace", self.spec.deployment, len(live), grace)
        await asyncio.gather(
            *(self._drain(i, grace) for i in list(self._instances.values()) if i.state != S.STOPPED),
            return_exceptions=True,
        )
        self._account(self._clock())

    # ---- one tick: observe, decide, apply ----------------------------------------------------------

    def _tick(self) -> None:
        if self._closing:
            return
        now = self._clock()
        self._reap_dead(now)
        self._reconcile()
        load = self._demand.load()
        if load.last_arrival is not None:  # gateways of their own know arrivals this pool never saw
            self._tracker.active(load.last_arrival)
        census = self._census()
        engines = self._engine_totals(census.routing)
        observation = self._tracker.observe(
            now,
            in_flight=load.in_flight,
            queued=load.queued,
            ready=len(census.routing),
            starting=len(census.coming),
            sleeping=census.sleeping,
            waking=len(census.waking),
            cached_tier=self._page.tier(now),
            snapshot_id=self.spec.snapshot.snapshot_id,
            can_sleep=self.can_sleep,
            engine_waiting=engines.waiting,
            kv_cache_usage=engines.kv_cache_usage,
        )
        decision, self._policy_state = self._bound.decide(observation, self._policy_state, now)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pool %s: %s from %s", self.spec.deployment, decision, observation)
        self.last_decision = decision
        if decision.ready == 0 and not census.coming and self._start_failures.lift() and not self._corrupt:
            self._demand.set_unavailable(None)  # nobody calls: the next request is held and tries again
        self._metrics.decided(self.spec.deployment, decision.ready, decision.sleeping, decision.forecast)
        start_on: tuple[str, ...] = ()
        if self._fleet is not None:
            decision, start_on = self._arbitrated(decision, load)
        self._apply(decision, census, now, load.outstanding, start_on)
        if self.spec.snapshot.snapshot_id in decision.warm:
            self._page.warm_in_background(now)
        self._account(now)

    def _engine_totals(self, routing: list[Instance]) -> EngineTotals:
        """The READY engines' latest figures; starts a scrape of those due if none is in flight. The
        tick never waits for it: what it reads shows at the next tick, a second later."""
        targets = {inst.id: inst.url for inst in routing}
        self._engines.retain(targets)
        if (task := self._scrape) is not None and task.done():
            self._scrape = None
            # An engine's fault is never raised (that engine just has no figures): this is a bug.
            if not task.cancelled() and (exc := task.exception()) is not None:
                log.error("pool %s: engine scrape failed: %r", self.spec.deployment, exc)
        if self._scrape is None and self._engines.due(targets):
            self._scrape = asyncio.create_task(
                self._engines.scrape(targets, {inst.id: inst.auth_headers for inst in routing}),
                name=f"scrape-{self.spec.deployment}",
            )
        return engine_totals(self._engines.latest.values())

    # ---- the fleet ------------------------------------------------------------------------------------

    def _arbitrated(self, decision: Decision, load: LoadView) -> tuple[Decision, tuple[str, ...]]:
        """The decision as the fleet grants it, and the devices its starts go on."""
        fp = self.spec.footprint
        self._outstanding = dict(load.outstanding)
        self._wish = Wish(
            self.name,
            decision.ready,
            decision.sleeping,
            fp.awake,
            fp.asleep,
            rate=decision.forecast or 0.0,
            horizon_s=self._tracker.startup.wake,
            held=load.queued,
        )
        grant = self._fleet.grant(self.name)
        if grant is None or (grant.ready, grant.sleeping) == (decision.ready, decision.sleeping):
            self._last_grant = ""
            return decision, grant.start_on if grant is not None else ()
        why = f"fleet: READY {decision.ready} -> {grant.ready}, SLEEPING {decision.sleeping} -> {grant.sleeping}"
        if grant.denied:
            why += f" ({grant.denied} awake not granted: no room yet)"
        if why != self._last_grant:  # once, not every tick it waits for room
            log.info("pool %s: %s", self.name, why)
        self._last_grant = why
        return replace(
            decision, ready=grant.ready, sleeping=grant.sleeping, reason=f"{decision.reason}; {why}"
        ), grant.start_on

    def fleet_wish(self) -> Wish | None:
        return self._wish

    def fleet_members(self) -> list[Member]:
        """Every instance that holds device memory: awake unless SLEEPING with no wake under way."""
        out = []
        for i in self._instances.values():
            if i.device is None or i.state == S.STOPPED:
                continue
            awake = i.state != S.SLEEPING or self._phases.get(i.id) == Phase.WAKING
            fp = self.spec.footprint
            holds = fp.awake if awake else fp.asleep
            out.append(Member(i.id, self.name, i.device, awake, self._outstanding.get(i.id, 0) > 0, holds))
        return out

    def _reserved(self, inst: Instance) -> int | None:
        if inst.device is None or self.spec.footprint is None:
            return None
        return next((m.holds for m in self.fleet_members() if m.id == inst.id), 0)

    def _census(self) -> Census:
        c = Census([], [], [], [], [], [])
        for inst in self._instances.values():
            phase = self._phases.get(inst.id)
            if phase == Phase.TO_SLEEP:
                c.to_sleep.append(inst)
            elif phase == Phase.FALLING_ASLEEP:
                c.falling.append(inst)
            elif phase == Phase.WAKING:
                c.waking.append(inst)
            elif inst.state == S.READY:
                c.routing.append(inst)
            elif inst.state in COMING_UP:
                c.coming.append(inst)
            elif inst.state == S.SLEEPING:
                c.asleep.append(inst)
        return c

    def _apply(
        self,
        decision: Decision,
        c: Census,
        now: float,
        outstanding: Mapping[str, int],
        start_on: tuple[str, ...] = (),
    ) -> None:
        """Carry out `warm_pool.plan`'s actions: tasks and backend calls. Fresh starts go on the
        devices in `start_on` (the fleet's), in order."""
        devices = iter(start_on)
        by_id = {inst.id: inst for group in c for inst in group}
        members = plan.Census(*(tuple(plan.Member(i.id, i.created_at, i.state_since) for i in g) for g in c))
        may_start = now >= self._not_before and self._corrupt is None
        actions = plan.plan(
            decision.ready,
            decision.sleeping,
            members,
            can_sleep=self.can_sleep,
            may_start=may_start,
            outstanding=outstanding,
        )
        for action in actions:
            match action:
                case plan.TakeBack(id=ident):
                    self._take_back(by_id[ident])
                case plan.Wake(id=ident):
                    self._begin_wake(by_id[ident])
                case plan.Start():
                    self._start_instance(now, next(devices, None))
                case plan.Cancel(id=ident):
                    if (task := self._launches.get(ident)) is not None:
                        task.cancel()
                case plan.Sleep(id=ident):
                    self._begin_sleep(by_id[ident])
                case plan.Drain(id=ident, grace=grace):
                    inst = by_id[ident]
                    self._spawn(
                        self._stops, inst, self._drain(inst, self.spec.grace_period_s if grace else 0.0)
                    )

    def _start_instance(self, now: float, device: str | None = None) -> None:
        inst = Instance(
            device=device,
            id=new_instance_id(self.spec.deployment),
            deployment=self.spec.deployment,
            created_at=now,
            max_concurrency=self.spec.instance_concurrency,
            host=self.spec.host,
            # Its engine serves only who holds this: the proxy, this pool. Nothing else on the
            # machine can call, sleep or wake it (vLLM guards only its /v1 routes with it).
            secret=secrets.token_urlsafe(32),
        )
        self._instances[inst.id] = inst
        self._spawn(self._launches, inst, self._launch(inst))

    def _reap_dead(self, now: float) -> None:
        """READY and SLEEPING instances whose process is gone become FAILED and are replaced."""
        for inst in list(self._instances.values()):
            if inst.state in (S.READY, S.SLEEPING) and self._ops.is_alive(inst) is False:
                if (task := self._turns.pop(inst.id, None)) is not None:
                    task.cancel()
                self._failed(inst, f"its engine ({self._ops.handle_name(inst)}) died", "serving")

    def _settled(self, inst: Instance) -> bool:
        """READY or SLEEPING with nothing of the pool's own in flight for it (start, sleep, wake, drain)."""
        busy = (self._phases, self._turns, self._stops, self._launches)
        return inst.state in (S.READY, S.SLEEPING) and not any(inst.id in tasks for tasks in busy)

    def _reconcile(self) -> None:
        """Correct what the pool believes by what the settled engines last said of their sleep, and
        ask them again when due (`warm_pool.reconcile`). The asking runs in the background: the tick
        never waits for it, and reads its answers at a later tick."""
        for seen in self._sleep_states.collect():
            inst = self._instances.get(seen.instance_id)
            # Gone, moved, or busy with a sleep, wake or drain since it was asked: the answer is stale.
            if inst is not None and inst.transitions == seen.transitions and self._settled(inst):
                self._correct(inst, seen.observed)
        if self.can_sleep:  # an engine without sleep mode serves no /is_sleeping
            self._sleep_states.start(i for i in self._instances.values() if self._settled(i))

    def _correct(self, inst: Instance, observed: Observed) -> None:
        fix = correction(inst.state, observed)
        if fix is Correction.NONE:
            return
        believed = inst.state.value
        log.warning("instance %s: believed %s, its engine says %s: %s", inst.id, believed, observed, fix)
        self._metrics.state_corrected(self.spec.deployment, believed, observed.value)
        if fix is Correction.REPLACE:
            self._failed(inst, "its engine refused the instance's key (401): it holds another", "key")
            return
        if fix is Correction.TO_READY:
            self._tiers[inst.id] = Tier.WAKE  # requests held for it were served by a wake
        self._move(inst, S.SLEEPING if fix is Correction.TO_SLEEPING else S.READY, self._clock())
        self._demand.capacity_changed()
        self._wake.set()  # the policy decides on the truth at once: wake it, or sleep it again

    def _failed(self, inst: Instance, why: str, phase: str) -> None:
        """Out of routing, FAILED, stopped and forgotten; its replacement waits for the backoff."""
        log.error("instance %s failed: %s", inst.id, why)
        now = self._clock()
        self._start_failures.failed(record_of(inst.id, phase, why, time.time(), inst.secret))
        self._phases.pop(inst.id, None)
        self._move(inst, S.FAILED, now)
        self._failed_start(now)
        self._demand.capacity_changed()
        self._spawn(self._stops, inst, self._stop_failed(inst, died=phase == "serving"))

    async def _stop_failed(self, inst: Instance, died: bool) -> None:
        code = await self._forget(inst, to=S.STOPPED)
        if died and code is not None:  # a status it ended with by itself, not our SIGTERM's
            self._start_failures.exit_code_known(inst.id, code)

    # ---- instance lifecycles -------------------------------------------------------------------------

    async def _launch(self, inst: Instance) -> None:
        spec, clock = self.spec, self._clock
        launch = Launch()
        try:
            await self._ops.launch(inst, launch, lambda: self._move(inst, S.STARTING, clock()))
        except (StartFailed, PoolError, OSError, SnapshotError) as exc:
            log.error("instance %s failed to start: %s", inst.id, exc)
            self._metrics.start_finished(spec.deployment, "failed")
            self._move(inst, S.FAILED, clock())
            self._failed_start(clock())
            reason = self._start_failures.start_failed(
                record_of(inst.id, launch.stage, exc, time.time(), inst.secret)
            )
            if isinstance(exc, SnapshotCorrupt) and self._corrupt is None:
                self._corrupt = str(exc)  # retrying cannot help: no more starts until a redeploy
                log.error("pool %s: starts no more instances: %s", spec.deployment, exc)
                self._demand.set_unavailable(f"deployment {spec.deployment!r}: {exc}")
            elif reason is not None and self._corrupt is None:
                log.error("pool %s: %s; held requests are refused while it retries", spec.deployment, reason)
                self._demand.set_unavailable(reason)
            await self._forget(inst, to=S.STOPPED)
            return
        except asyncio.CancelledError:
            await self._forget(inst, to=S.STOPPED)
            raise
        self._learn_capabilities(launch.capabilities)
        self._metrics.observe_cold_start(
            spec.deployment, split_cold_start(launch.snapshot_s, launch.process_s, launch.phases or {})
        )
        self._metrics.start_finished(spec.deployment, "ready")
        self._failures = 0
        if self._start_failures.started() and self._corrupt is None:
            self._demand.set_unavailable(None)
        self._became_ready(inst, launch.acquired.tier, inst.created_at)
        log.info(
            "instance %s ready at %s after %.2fs (%s)",
            inst.id,
            inst.url,
            launch.snapshot_s + launch.process_s,
            launch.acquired.tier,
        )

    async def adopt(self, running: list[Running]) -> list[str]:
        """Take over engines a previous controller started for this deployment: each joins as READY
        or SLEEPING, as its engine says, with no start counted; one that does not answer as ours is
        stopped. The ids adopted."""
        adopted = []
        # What they served is unknown here: as far as idleness goes, they were in use until now, so
        # the policy does not scale down before the deployment has been idle for its timeout.
        self._tracker.active(self._clock())
        for found in running:
            now = self._clock()
            inst = Instance(
                id=found.instance_id,
                deployment=self.spec.deployment,
                created_at=now,
                max_concurrency=self.spec.instance_concurrency,
                host=self.spec.host,
                secret=found.secret,
            )
            if self._fleet is not None and len(self._fleet.devices.devices) == 1:
                inst.device = self._fleet.devices.devices[0].id  # one shared device: it is on it
            self._instances[inst.id] = inst
            try:
                observed, caps = await self._ops.adopt(inst, found)
            except PoolError as exc:
                observed, caps = Observed.UNKNOWN, None
                log.warning("instance %s: %s", inst.id, exc)
            if (why := unreachable(observed)) is not None:
                log.warning("instance %s (%s) not adopted: %s; stopping it", inst.id, found.handle.name, why)
                await self._forget(inst, to=S.STOPPED)
                continue
            self._learn_capabilities(caps)
            self._move(inst, S.STARTING, now)
            self._move(inst, S.READY, now)
            if observed is Observed.ASLEEP:
                self._move(inst, S.SLEEPING, now)
            log.info("instance %s adopted (%s, %s) at %s", inst.id, found.handle.name, inst.state, inst.url)
            adopted.append(inst.id)
        if adopted and self._demand is not None:
            self._demand.capacity_changed()
        self._wake.set()
        return adopted

    def _became_ready(self, inst: Instance, tier: Tier, asked_at: float) -> None:
        """READY and routable; the seconds since it was asked for feed the tracker and the metrics."""
        now = self._clock()
        self._move(inst, S.READY, now)
        self._tiers[inst.id] = tier
        self._tracker.started(tier, now - asked_at)
        self._metrics.observe_startup(self.spec.deployment, tier.value, now - asked_at)
        self._demand.capacity_changed()

    def _learn_capabilities(self, caps) -> None:
        """What the engine says it can do decides the tiers the policy gets: an engine without sleep
        (vLLM's CPU build) is never put to sleep; its idle instances stop instead."""
        if caps is None:
            return
        if self.can_sleep != caps.can_sleep:
            log.info(
                "pool %s: engine sleep levels %s: %s",
                self.spec.deployment,
                list(caps.sleep_levels) or "none",
                "idle instances sleep" if caps.can_sleep else "idle instances stop instead of sleeping",
            )
        self.can_sleep = caps.can_sleep

    def _begin_sleep(self, inst: Instance) -> None:
        self._phases[inst.id] = Phase.TO_SLEEP
        self._demand.capacity_changed()  # out of routing before anything else
        self._spawn(self._turns, inst, self._sleep(inst))

    def _take_back(self, inst: Instance) -> None:
        """An instance waiting for its requests before a sleep: back into routing, the sleep called off."""
        del self._phases[inst.id]
        if (task := self._turns.pop(inst.id, None)) is not None:
            task.cancel()  # it is in its wait, which has nothing to undo
        self._demand.capacity_changed()

    async def _sleep(self, inst: Instance) -> None:
        """Wait (within the grace period) for its requests to finish, then put it to sleep."""
        deadline = self._clock() + self.spec.grace_period_s
        # A bounded poll of the activator's counter, as in `_drain`.
        while self._demand.load().outstanding.get(inst.id, 0) > 0 and self._clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        self._phases[inst.id] = Phase.FALLING_ASLEEP
        try:
            await self._ops.sleep(inst)
        except PoolError as exc:
            self._metrics.sleep_wake_finished(self.spec.deployment, "sleep", ok=False)
            self._failed(inst, f"sleep failed: {exc}", "sleep")
            return
        finally:
            if self._phases.get(inst.id) == Phase.FALLING_ASLEEP:
                del self._phases[inst.id]
        self._metrics.sleep_wake_finished(self.spec.deployment, "sleep", ok=True)
        self._move(inst, S.SLEEPING, self._clock())
        log.info("instance %s asleep", inst.id)
        self._wake.set()  # the loop may want it awake again already

    def _begin_wake(self, inst: Instance) -> None:
        self._phases[inst.id] = Phase.WAKING
        self._spawn(self._turns, inst, self._wake_up(inst, self._clock()))

    async def _wake_up(self, inst: Instance, asked_at: float) -> None:
        try:
            await self._ops.wake(inst)
        except PoolError as exc:
            self._metrics.sleep_wake_finished(self.spec.deployment, "wake", ok=False)
            self._failed(inst, f"wake-up failed: {exc}", "wake")
            return
        finally:
            if self._phases.get(inst.id) == Phase.WAKING:
                del self._phases[inst.id]
        self._metrics.sleep_wake_finished(self.spec.deployment, "wake", ok=True)
        self._became_ready(inst, Tier.WAKE, asked_at)
        log.info("instance %s awake after %.2fs", inst.id, self._clock() - asked_at)

    async def _drain(self, inst: Instance, grace_s: float) -> None:
        """Out of the routing set, let in-flight requests finish within `grace_s`, then stop. A
        sleeping instance has none: it is stopped at once."""
        if inst.state in (S.READY, S.SLEEPING):
            was_ready = inst.state == S.READY
            self._move(inst, S.DRAINING, self._clock())
            if was_ready:
                self._demand.capacity_changed()
                deadline = self._clock() + grace_s
                # A bounded poll of the activator's counter: 50 ms of latency on a drain costs nothing.
                while self._demand.load().outstanding.get(inst.id, 0) > 0 and self._clock() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        await self._forget(inst, to=S.STOPPED)

    async def _forget(self, inst: Instance, to: InstanceState | None = None) -> int | None:
        """Stop the instance's engine and drop it from the pool; its exit status where the backend
        knows it."""
        code = await self._ops.stop(inst)
        if to is not None and inst.state != to:
            self._move(inst, to, self._clock())
        self._phases.pop(inst.id, None)
        self._instances.pop(inst.id, None)
        self._account(self._clock())
        return code

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
        if self._fleet is not None and inst.device is not None and new in (S.SLEEPING, S.STOPPED, S.READY):
            self._fleet.changed()  # memory came free (or a wake finished): pools waiting may go

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
