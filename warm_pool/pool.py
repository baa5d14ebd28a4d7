"""The pool of one deployment: a thin loop around the deployment's scaling policy. Its collaborators:
its instances and their way through their states (`warm_pool.lifecycle`), the observer
(`warm_pool.observe`), its seat among shared devices (`warm_pool.fleet_seat`), its recycler
(`warm_pool.recycler`); its settings are `warm_pool.pool_spec`'s, the census it decides on
`warm_pool.census`'s.

Every second, and at once when poked (a request arrived with nothing to serve it), the loop runs one
tick (`_tick`), seven stages in this order, as the simulator does (`warm_pool.simulate`,
`warm_pool.fleet_sim`) through the same tracker, policy, arbiter, fits-now and plan functions:

1. check (`warm_pool.lifecycle`): a READY or SLEEPING instance whose process is gone is FAILED and
   replaced; what the settled engines last said of their sleep corrects the pool's belief.
2. observe (`warm_pool.observe.Observer`): the activator's or gateways' load (requests in flight,
   held, outstanding per instance), the instances by group (`warm_pool.census`: on their way to
   sleep count as sleeping, waking ones as waking), the READY engines' queue and KV-cache figures,
   and the tracker's arrivals and start-up times (it has heard of every request's arrival and end,
   and of every start's tier and seconds to READY) → the policy's `Observation`. An instance past
   its age (`--max-instance-age`, `warm_pool.recycle`) is left out of what the decision and the plan
   count, so a replacement comes up first.
3. decide (`warm_pool.policies`): `bound.decide(observation, state, now)` → `Decision(ready,
   sleeping, warm)`.
4. arbitrate and fit (`warm_pool.fleet_seat`, with a fleet only): the fleet runs the arbiter over
   every pool's wish (`warm_pool.arbiter.arbitrate`) and cuts this pool's growth to what fits the
   memory free now (`arbiter.fits_now`) → the decision as granted, and the devices its starts go on.
5. recycle (`warm_pool.recycler`): once its replacement is READY, an old instance is drained.
6. plan (`warm_pool.plan.plan`, pure): up, instances on their way to sleep that have not slept yet
   go back into routing; sleeping ones wake (`POST /wake_up`, then back into routing); the rest
   start (PENDING → STARTING → READY). Down: starts are cancelled (newest first), then the least
   busy READY instances leave routing and, once their requests are done (within the grace period),
   go to sleep (`POST /sleep?level=1`) while fewer sleep than asked, or are drained and stopped;
   sleeping instances beyond what is asked are stopped.
7. apply (`warm_pool.lifecycle`, through the backend, `warm_pool.backends`): the plan's actions as
   tasks; a snapshot the policy wants warm is read into the page cache in the background; the
   LoRA adapters it expects a request for (`Decision.adapters`) go to `on_adapters`, which loads
   them onto a READY instance ahead of that request (`stoker.control.adapters`).

The recycle stage comes after the grant (and not before it) because retiring the old instance
waits for what the fleet granted: the fleet is asked for the old instance too while its
replacement comes up (`Recycler.wish`), since the old one holds memory until it is drained.

The engines' own word on their sleep overrides the pool's belief: every `reconcile_interval_s`
(5 s) each settled instance (READY or SLEEPING, no start, sleep, wake or drain of the pool's in
flight) is asked `GET /is_sleeping` in the background, read at a later tick (`warm_pool.reconcile`).
A READY instance found asleep (slept by someone else) leaves routing as SLEEPING, and the policy
wakes or stops it; a SLEEPING one found awake joins routing as READY, and the policy puts it back
to sleep if it is not wanted; one that refuses the instance's key (401) is replaced. No answer is no
news: liveness is the activator's probes' and the check stage's.

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
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from snapshots import WarmReport
from warm_pool import engine_tls, plan
from warm_pool.arbiter import Wish
from warm_pool.backends.base import Backend, Running
from warm_pool.census import Census, Member
from warm_pool.engine_calls import HttpEngines
from warm_pool.engine_signals import EngineScraper
from warm_pool.errors import PoolError
from warm_pool.failures import FailureRecord
from warm_pool.fleet import Fleet
from warm_pool.fleet_seat import FleetSeat
from warm_pool.instances import InstanceOps
from warm_pool.launch import GpuInventory
from warm_pool.lifecycle import Lifecycle
from warm_pool.metrics import PoolMetrics
from warm_pool.observe import Observer, View
from warm_pool.page_tier import PageTier
from warm_pool.policies import checkpoint
from warm_pool.policies.base import Decision, ScalingConfig, Tier
from warm_pool.policies.rules import RuledState
from warm_pool.policies.settings import bind_policy, startup_priors
from warm_pool.pool_spec import Demand, PoolSpec
from warm_pool.recycler import Recycler
from warm_pool.states import Instance, InstanceState
from warm_pool.tracker import ObservationTracker

log = logging.getLogger("stoker.pool")


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
        self._spec = spec  # changed through the `spec` setter, which tells the lifecycle and the ops
        self.name = spec.key  # unique among pools: the fleet and the gauges tell them apart by it
        self._metrics = metrics
        self._clock = clock
        self._fleet = fleet if spec.footprint is not None else None
        # The pool's seat among shared devices, and its recycler (`warm_pool.fleet_seat`, `warm_pool.recycler`).
        self._seat = FleetSeat(self.name, self._fleet) if self._fleet is not None else None
        self._recycler = Recycler(self.name, spec.deployment, metrics)
        self._tick_s = tick_s
        self._bound = bind_policy(spec.policy, spec.scaling)
        self._policy_state = self._bound.initial_state
        cpu_vllm = spec.engine == "vllm" and spec.vllm is not None and spec.vllm.runtime.cpu_build
        self._tracker = ObservationTracker(startup_priors("vllm-cpu" if cpu_vllm else spec.engine))
        self._wake = asyncio.Event()
        self._closing = False
        # Its instances, what is in flight for each, its failed starts (`warm_pool.lifecycle`).
        self.lifecycle = Lifecycle(
            spec,
            self._ops,
            metrics,
            self._tracker,
            self._recycler,
            clock=clock,
            fleet=self._fleet,
            poke=self.poke,
        )
        self.last_decision: Decision | None = None
        self._start_tier: Tier | None = None  # where the next start comes from, as last observed
        self._told_start: float | None = None  # the expected start a demand elsewhere was last told
        # The LoRA adapters the policy expects a request for soon (`Decision.adapters`), handed each
        # tick there is a READY instance to load them on: set by the platform, which knows them.
        self.on_adapters: Callable[[tuple[str, ...]], None] = lambda names: None
        self._page = PageTier(spec.deployment, spec.snapshot)  # the snapshot in the page cache
        # The observe stage (`warm_pool.observe`): the load, the census, the READY engines' own queue
        # and KV-cache figures (read in the background, each engine at most every 5 s of this pool's
        # clock) and the tracker, into the policy's observation.
        self._observer = Observer(
            self._tracker,
            EngineScraper(clock, tls=engine_tls.of(backend)),
            self._page,
            backend,
            self._recycler,
        )
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
        self.lifecycle.spec = spec

    # ---- the activator's InstanceSource -------------------------------------------------------------

    def endpoints(self) -> list[Instance]:
        return self.lifecycle.endpoints()

    def engines(self) -> list[Instance]:
        """Every instance whose engine serves HTTP now: READY (routing or not), SLEEPING, DRAINING.
        For reading them (their metrics), never for routing: that is `endpoints`."""
        return self.lifecycle.engines()

    def poke(self) -> None:
        self._wake.set()

    def report_failure(self, endpoint_id: str) -> None:
        log.warning("instance %s failed a request; checking it", endpoint_id)
        self._wake.set()

    def report_unhealthy(self, endpoint_id: str, reason: str) -> None:
        """The activator's probe says the engine is failed: replaced, as a dead process is. Ignored
        unless it is still in the routing set (one on its way to sleep or out may answer 503)."""
        if self.lifecycle.unhealthy(endpoint_id, reason):
            self._wake.set()

    def request_arrived(self) -> None:
        self._tracker.arrived(self._clock())
        self._metrics.arrived(self.spec.deployment)

    def adapter_arrived(self, adapter: str) -> None:
        """A request for LoRA adapter deployment `adapter`, served on this deployment's instances
        (counted as an arrival by `request_arrived`, through the activator): for the adapter's own
        forecast (`warm_pool.policies.adapter_forecast`)."""
        self._tracker.adapter_arrived(self._clock(), adapter)

    def adapter_loaded(self, seconds: float) -> None:
        """An adapter was loaded onto one of the instances in `seconds`: the adapter tier."""
        self._tracker.adapter_loaded(seconds, self._clock())

    def expected_start_s(self) -> float | None:
        """How long the start a held request waits on is expected to take: the measured figure of
        the tier it comes from (`TierTimes`, the priors until one is measured). The activator holds
        requests that long, and more (`activator.Activator._hold_for`)."""
        if self._start_tier is None:
            return None
        return self._tracker.startup.of(self._start_tier)

    def _tell_expected_start(self) -> None:
        """A demand in other processes (the controller's `GatewayLoad`: the gateways hold requests
        by it) is told when the figure changes: after a start is measured, or the tier changes."""
        tell = getattr(self._demand, "expected_start_changed", None)
        seconds = self.expected_start_s()
        if tell is not None and seconds != self._told_start:
            self._told_start = seconds
            tell()

    def request_finished(self, service_s: float | None, cold_on: str | None) -> None:
        self._tracker.finished(self._clock(), service_s)
        if cold_on is not None:
            tier = self.lifecycle.tier_of(cold_on)
            if tier is None:  # practically never: 256 newer instances came up meanwhile
                log.warning("cold start on %s, whose tier is forgotten; not counted", cold_on)
            else:
                self._metrics.cold_request(self.spec.deployment, tier.value)

    # ---- wiring and control ---------------------------------------------------------------------------

    def attach(self, demand: Demand) -> None:
        self._demand = self.lifecycle.demand = demand

    def reconfigure(self, scaling: ScalingConfig, policy: str) -> None:
        """New settings take effect at the next tick (now). Another policy starts from its initial
        state; the same one keeps what it learned."""
        bound = bind_policy(policy, scaling)
        if bound.name != self._bound.name:
            self._policy_state = bound.initial_state
        self._bound = bound
        self.spec = replace(self.spec, scaling=scaling, policy=policy)
        if self.lifecycle.redeployed() and self._demand is not None:
            self._demand.set_unavailable(None)  # held requests wait for one more try
        self._wake.set()

    def saved_policy(self) -> tuple[str, RuledState]:
        """The policy's name and the state it has learned, for a checkpoint
        (`warm_pool.policies.checkpoint`)."""
        return self._bound.name, self._policy_state

    def restore_policy(self, policy: str, state: RuledState) -> bool:
        """Carry on from a previous run's learned `state` of `policy`: only if it is this pool's
        policy and fits its settings (`checkpoint.fits`); otherwise the pool keeps its initial
        state, as `reconfigure` starts another policy. Before the loop's first tick."""
        if policy != self._bound.name or not checkpoint.fits(policy, state, self._bound.config):
            return False
        self._policy_state = state
        return True

    @property
    def can_sleep(self) -> bool:
        """False once an engine reported no sleep levels (vLLM's CPU build): then nothing sleeps."""
        return self.lifecycle.can_sleep

    @property
    def policy(self) -> str:
        return self._bound.name

    @property
    def unavailable(self) -> str | None:
        """Why no instance can start: a corrupt snapshot (until the deployment is deployed again), or
        `unavailable_after` failed starts in a row (until one succeeds)."""
        return self.lifecycle.corrupt or self.lifecycle.start_failures.unavailable

    @property
    def last_failure(self) -> FailureRecord | None:
        return self.lifecycle.start_failures.last

    @property
    def failed_starts(self) -> int:
        """Failed starts since the last one that reached READY."""
        return self.lifecycle.start_failures.in_a_row

    def instances(self) -> list[dict]:
        """Each instance as an operator sees it; `since` is when it entered its state (epoch s)."""
        now, wall = self._clock(), time.time()
        return [
            {
                "id": i.id,
                "state": i.state.value,
                "phase": self.lifecycle.phases.get(i.id),
                "url": i.url if i.port is not None or i.address is not None else None,
                "runs_as": self._ops.handle_name(i),  # "pid 4242", "pod ns/name": where to look
                # Why a start is held up, where the backend can tell (a pod the scheduler cannot place).
                "held_up": self._ops.held_up(i) if i.state == InstanceState.STARTING else None,
                "device": i.device,
                "reserved_bytes": self._reserved(i),
                "since": wall - (now - i.state_since),
                "age_s": self._recycler.age_of(
                    i.id, now
                ),  # since READY first; what --max-instance-age counts
            }
            for i in sorted(self.lifecycle.instances.values(), key=lambda i: i.created_at)
        ]

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in InstanceState}
        for inst in self.lifecycle.instances.values():
            counts[inst.state.value] += 1
        return counts

    async def adopt(self, running: list[Running]) -> list[str]:
        """Take over engines a previous controller started for this deployment (`Lifecycle.adopt`)."""
        return await self.lifecycle.adopt(running)

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
        await self.lifecycle.halt(*self._observer.cancel())
        if self._fleet is not None:
            self._fleet.forget(self.name)
        await self._page.close()
        await self._observer.aclose()
        grace = None if not stop_instances else self.spec.grace_period_s if drain else 0.0
        await self.lifecycle.close(grace)

    # ---- one tick, its stages in the order they run -------------------------------------------------

    def _tick(self) -> None:
        if self._closing:
            return
        now = self._clock()
        self.lifecycle.check(now)
        view = self._observer.observe(
            now,
            self._demand.load(),
            self.lifecycle.instances,
            self.lifecycle.phases,
            spec=self.spec,
            can_sleep=self.lifecycle.can_sleep,
            last=self.last_decision,
            leaving=self.lifecycle.stops.keys(),
        )
        self._start_tier = view.observation.start_tier
        self._tell_expected_start()
        decision = self._decide(view, now)
        granted, start_on = self._arbitrate(decision, view, now)
        census = self._recycle(view, decision.ready, granted.ready, now)
        actions = self._plan(granted, census, view.load.outstanding, now)
        self._apply(actions, granted, start_on, now)

    def _decide(self, view: View, now: float) -> Decision:
        """The policy (`warm_pool.policies`, pure), bound with the shared rules."""
        decision, self._policy_state = self._bound.decide(view.observation, self._policy_state, now)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pool %s: %s from %s", self.spec.deployment, decision, view.observation)
        self.last_decision = decision
        if decision.ready == 0 and not view.census.coming and self.lifecycle.idle_lift():
            self._demand.set_unavailable(None)  # nobody calls: the next request is held and tries again
        self._metrics.decided(self.name, decision.ready, decision.sleeping, decision.forecast)
        return decision

    def _arbitrate(self, decision: Decision, view: View, now: float) -> tuple[Decision, tuple[str, ...]]:
        """The decision as the fleet grants it (`warm_pool.fleet_seat`: the arbiter, then what fits
        now), and the devices its starts go on. An instance being replaced is asked for too."""
        if self._seat is None:
            return decision, ()
        wish = self._recycler.wish(decision)
        granted, start_on = self._seat.arbitrate(
            wish, view.load, self.spec.footprint, self._tracker.startup.wake, now
        )
        return self._recycler.granted(granted), start_on

    def _recycle(self, view: View, wanted: int, granted: int, now: float) -> Census:
        """The census the plan gets (`warm_pool.recycler`); an old instance replaced is drained."""
        census, retire = self._recycler.settle(
            view.full, view.census, wanted, granted, now, self.spec.max_instance_age_s
        )
        if retire is not None:
            self.lifecycle.retire(retire, self.spec.grace_period_s)
        return census

    def _plan(
        self, decision: Decision, census: Census, outstanding: Mapping[str, int], now: float
    ) -> list[plan.Action]:
        """The actions that turn the census into the decision (`warm_pool.plan`, pure)."""
        return plan.plan(
            decision.ready,
            decision.sleeping,
            census,
            can_sleep=self.lifecycle.can_sleep,
            may_start=self.lifecycle.may_start(now),
            outstanding=outstanding,
        )

    def _apply(
        self, actions: list[plan.Action], decision: Decision, start_on: tuple[str, ...], now: float
    ) -> None:
        """Carry out the plan's actions (tasks and backend calls, `warm_pool.lifecycle`). Fresh starts
        go on the devices in `start_on` (the fleet's), in order."""
        devices, life = iter(start_on), self.lifecycle
        for action in actions:
            match action:
                case plan.TakeBack(id=ident):
                    life.take_back(ident)
                case plan.Wake(id=ident):
                    life.begin_wake(ident)
                case plan.Start():
                    life.start(now, next(devices, None))
                case plan.Cancel(id=ident):
                    life.cancel_start(ident)
                case plan.Sleep(id=ident):
                    life.begin_sleep(ident)
                case plan.Drain(id=ident, grace=grace):
                    life.retire(ident, self.spec.grace_period_s if grace else 0.0)
        if self.spec.snapshot.snapshot_id in decision.warm:
            self._page.warm_in_background(now)
        if decision.adapters and self.lifecycle.endpoints():
            self.on_adapters(decision.adapters)
        self.lifecycle.account(now)

    # ---- the fleet's FleetMember ----------------------------------------------------------------------

    def fleet_wish(self) -> Wish | None:
        return self._seat.wish if self._seat is not None else None

    def fleet_members(self) -> list[Member]:
        if self._seat is None or self.spec.footprint is None:
            return []
        return self._seat.members(
            self.lifecycle.instances.values(), self.lifecycle.phases, self.spec.footprint
        )

    def _reserved(self, inst: Instance) -> int | None:
        if inst.device is None or self.spec.footprint is None:
            return None
        return next((m.holds for m in self.fleet_members() if m.id == inst.id), 0)
