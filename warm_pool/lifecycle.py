"""One deployment's instances and their way through their states, a collaborator of
`warm_pool.pool.Pool` (the loop decides; this carries each instance through what it decided): start,
adopt, sleep, wake, drain, fail and be replaced, and the corrections its engine's own word on its
sleep makes (`warm_pool.reconcile`). It holds what the pool knows of its instances — the instances
by id, the ones in the middle of a sleep or a wake (`phases`), the tasks in flight for each, the
tier each latest READY came from, the failed starts and the restart backoff — and the pool reads
them from here (the observe stage, the fleet seat, `stoker describe`). The work on the engine
itself is `warm_pool.instances`."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from cachetools import LRUCache

from snapshots import SnapshotError
from warm_pool import engine_tls
from warm_pool.backends.base import Running, start_tier
from warm_pool.backoff import restart_delay
from warm_pool.census import Phase
from warm_pool.errors import PoolError, SnapshotCorrupt, StartFailed
from warm_pool.failures import StartFailures, record_of
from warm_pool.fleet import Fleet
from warm_pool.instances import InstanceOps, Launch, unreachable
from warm_pool.metrics import PoolMetrics, split_cold_start
from warm_pool.policies.base import Tier
from warm_pool.pool_spec import Demand, PoolSpec
from warm_pool.reconcile import Correction, Observed, SleepStates, correction
from warm_pool.recycler import Recycler
from warm_pool.states import Instance, InstanceState, new_instance_id
from warm_pool.tracker import ObservationTracker

log = logging.getLogger("stoker.pool")
S = InstanceState


class Lifecycle:
    def __init__(
        self,
        spec: PoolSpec,
        ops: InstanceOps,
        metrics: PoolMetrics,
        tracker: ObservationTracker,
        recycler: Recycler,
        *,
        clock: Callable[[], float],
        fleet: Fleet | None,
        poke: Callable[[], None],  # the pool's loop runs a tick at once
    ) -> None:
        self.spec = spec
        self.name = spec.key
        self._ops, self._metrics, self._tracker, self._recycler = ops, metrics, tracker, recycler
        self._clock, self._fleet, self._poke = clock, fleet, poke
        self.demand: Demand | None = None  # attached by the pool before its loop runs
        self.instances: dict[str, Instance] = {}
        self.phases: dict[str, Phase] = {}  # instances in the middle of a sleep or a wake
        # Where each instance's latest READY came from, for counting cold starts by tier. Bounded:
        # a request can only outlive its instance by the grace period, so 256 is plenty.
        self._tiers: LRUCache[str, Tier] = LRUCache(maxsize=256)
        self.launches: dict[str, asyncio.Task] = {}  # starts in progress, cancellable
        self.turns: dict[str, asyncio.Task] = {}  # sleeps and wakes in progress, cancellable
        self.stops: dict[str, asyncio.Task] = {}  # drains and stops in progress, never cancelled
        self._failures = 0  # consecutive failed starts, for the restart backoff
        self._not_before = 0.0  # no new start before this time (backoff after a failure)
        self.corrupt: str | None = None  # set when a start found the snapshot corrupt: no more starts
        # The last failure of any instance, and failed starts in a row (`warm_pool.failures`).
        self.start_failures = StartFailures(spec.unavailable_after)
        # False once an engine reports no sleep levels (vLLM's CPU build): then nothing is put to sleep.
        self.can_sleep: bool = True
        # What the settled engines say of their sleep, asked in the background (`reconcile`).
        self.sleep_states = SleepStates(
            clock, interval_s=spec.reconcile_interval_s, name=spec.deployment, tls=engine_tls.of(ops.backend)
        )

    # ---- what the pool reads -------------------------------------------------------------------------

    def endpoints(self) -> list[Instance]:
        """The routing set: READY, with no sleep or wake under way."""
        return [i for i in self.instances.values() if i.state == S.READY and i.id not in self.phases]

    def engines(self) -> list[Instance]:
        """Every instance whose engine serves HTTP now: READY (routing or not), SLEEPING, DRAINING."""
        return [i for i in self.instances.values() if i.state in (S.READY, S.SLEEPING, S.DRAINING)]

    def tier_of(self, instance_id: str) -> Tier | None:
        return self._tiers.get(instance_id)

    def may_start(self, now: float) -> bool:
        """No start during the restart backoff, nor once the snapshot is known corrupt."""
        return now >= self._not_before and self.corrupt is None

    def redeployed(self) -> bool:
        """Deployed again: the snapshot gets one more start to check out, and held requests wait for
        one more try. True when the deployment was unavailable and no longer is."""
        lifted = self.start_failures.lift()
        was_corrupt, self.corrupt = self.corrupt is not None, None
        return was_corrupt or lifted

    def idle_lift(self) -> bool:
        """Nobody calls: unavailability after failed starts is lifted (the count is kept), so the
        next request is held and tries again. True when it was lifted."""
        return self.start_failures.lift() and not self.corrupt

    # ---- the check stage ---------------------------------------------------------------------------

    def check(self, now: float) -> None:
        """The engines' own word first: dead ones are replaced, sleep beliefs corrected."""
        self._reap_dead()
        self._reconcile()

    def _reap_dead(self) -> None:
        """READY and SLEEPING instances whose process is gone become FAILED and are replaced."""
        for inst in list(self.instances.values()):
            if inst.state in (S.READY, S.SLEEPING) and self._ops.is_alive(inst) is False:
                if (task := self.turns.pop(inst.id, None)) is not None:
                    task.cancel()
                self.fail(inst, f"its engine ({self._ops.handle_name(inst)}) died", "serving")

    def unhealthy(self, instance_id: str, reason: str) -> bool:
        """The activator's probe says the engine is failed: replaced, as a dead process is. Ignored
        unless it is still in the routing set (one on its way to sleep or out may answer 503)."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.state != S.READY or inst.id in self.phases:
            return False
        if (task := self.turns.pop(inst.id, None)) is not None:
            task.cancel()
        self.fail(inst, reason, "health")
        return True

    def _settled(self, inst: Instance) -> bool:
        """READY or SLEEPING with nothing of the pool's own in flight for it (start, sleep, wake, drain)."""
        busy = (self.phases, self.turns, self.stops, self.launches)
        return inst.state in (S.READY, S.SLEEPING) and not any(inst.id in tasks for tasks in busy)

    def _reconcile(self) -> None:
        """Correct what the pool believes by what the settled engines last said of their sleep, and
        ask them again when due (`warm_pool.reconcile`). The asking runs in the background: the tick
        never waits for it, and reads its answers at a later tick."""
        for seen in self.sleep_states.collect():
            inst = self.instances.get(seen.instance_id)
            # Gone, moved, or busy with a sleep, wake or drain since it was asked: the answer is stale.
            if inst is not None and inst.transitions == seen.transitions and self._settled(inst):
                self._correct(inst, seen.observed)
        if self.can_sleep:  # an engine without sleep mode serves no /is_sleeping
            self.sleep_states.start(i for i in self.instances.values() if self._settled(i))

    def _correct(self, inst: Instance, observed: Observed) -> None:
        fix = correction(inst.state, observed)
        if fix is Correction.NONE:
            return
        believed = inst.state.value
        log.warning("instance %s: believed %s, its engine says %s: %s", inst.id, believed, observed, fix)
        self._metrics.state_corrected(self.spec.deployment, believed, observed.value)
        if fix is Correction.REPLACE:
            self.fail(inst, "its engine refused the instance's key (401): it holds another", "key")
            return
        if fix is Correction.TO_READY:
            self._tiers[inst.id] = Tier.WAKE  # requests held for it were served by a wake
        self._move(inst, S.SLEEPING if fix is Correction.TO_SLEEPING else S.READY, self._clock())
        self.demand.capacity_changed()
        self._poke()  # the policy decides on the truth at once: wake it, or sleep it again

    def fail(self, inst: Instance, why: str, phase: str) -> None:
        """Out of routing, FAILED, stopped and forgotten; its replacement waits for the backoff."""
        log.error("instance %s failed: %s", inst.id, why)
        now = self._clock()
        self.start_failures.failed(record_of(inst.id, phase, why, time.time(), inst.secret))
        self.phases.pop(inst.id, None)
        self._move(inst, S.FAILED, now)
        self._failed_start(now)
        self.demand.capacity_changed()
        self._spawn(self.stops, inst, self._stop_failed(inst, died=phase == "serving"))

    async def _stop_failed(self, inst: Instance, died: bool) -> None:
        code = await self._forget(inst, to=S.STOPPED)
        if died and code is not None:  # a status it ended with by itself, not our SIGTERM's
            self.start_failures.exit_code_known(inst.id, code)

    # ---- the apply stage: the plan's actions ---------------------------------------------------------

    def start(self, now: float, device: str | None = None) -> None:
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
        self.instances[inst.id] = inst
        self._spawn(self.launches, inst, self._launch(inst))

    def cancel_start(self, instance_id: str) -> None:
        if (task := self.launches.get(instance_id)) is not None:
            task.cancel()

    def retire(self, instance_id: str, grace_s: float) -> None:
        """Drained (within `grace_s`) and stopped, in the background."""
        inst = self.instances[instance_id]
        self._spawn(self.stops, inst, self.drain(inst, grace_s))

    # ---- each instance's way -------------------------------------------------------------------------

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
            reason = self.start_failures.start_failed(
                record_of(inst.id, launch.stage, exc, time.time(), inst.secret)
            )
            if isinstance(exc, SnapshotCorrupt) and self.corrupt is None:
                self.corrupt = str(exc)  # retrying cannot help: no more starts until a redeploy
                log.error("pool %s: starts no more instances: %s", spec.deployment, exc)
                self.demand.set_unavailable(f"deployment {spec.deployment!r}: {exc}")
            elif reason is not None and self.corrupt is None:
                log.error("pool %s: %s; held requests are refused while it retries", spec.deployment, reason)
                self.demand.set_unavailable(reason)
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
        if self.start_failures.started() and self.corrupt is None:
            self.demand.set_unavailable(None)
        self._became_ready(inst, start_tier(launch.acquired.tier, launch.from_runtime), inst.created_at)
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
            self.instances[inst.id] = inst
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
            self._recycler.first_ready(
                inst.id, now
            )  # its age counts from its adoption: its start is unknown here
            if observed is Observed.ASLEEP:
                self._move(inst, S.SLEEPING, now)
            log.info("instance %s adopted (%s, %s) at %s", inst.id, found.handle.name, inst.state, inst.url)
            adopted.append(inst.id)
        if adopted and self.demand is not None:
            self.demand.capacity_changed()
        self._poke()
        return adopted

    def _became_ready(self, inst: Instance, tier: Tier, asked_at: float) -> None:
        """READY and routable; the seconds since it was asked for feed the tracker and the metrics."""
        now = self._clock()
        self._move(inst, S.READY, now)
        self._recycler.first_ready(inst.id, now)
        self._tiers[inst.id] = tier
        self._tracker.started(tier, now - asked_at)
        self._metrics.observe_startup(self.spec.deployment, tier.value, now - asked_at)
        self.demand.capacity_changed()

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

    def begin_sleep(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        self.phases[inst.id] = Phase.TO_SLEEP
        self.demand.capacity_changed()  # out of routing before anything else
        self._spawn(self.turns, inst, self._sleep(inst))

    def take_back(self, instance_id: str) -> None:
        """An instance waiting for its requests before a sleep: back into routing, the sleep called off."""
        del self.phases[instance_id]
        if (task := self.turns.pop(instance_id, None)) is not None:
            task.cancel()  # it is in its wait, which has nothing to undo
        self.demand.capacity_changed()

    async def _sleep(self, inst: Instance) -> None:
        """Wait (within the grace period) for its requests to finish, then put it to sleep."""
        deadline = self._clock() + self.spec.grace_period_s
        # A bounded poll of the activator's counter, as in `drain`.
        while self.demand.load().outstanding.get(inst.id, 0) > 0 and self._clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        self.phases[inst.id] = Phase.FALLING_ASLEEP
        try:
            await self._ops.sleep(inst)
        except PoolError as exc:
            self._metrics.sleep_wake_finished(self.spec.deployment, "sleep", ok=False)
            self.fail(inst, f"sleep failed: {exc}", "sleep")
            return
        finally:
            if self.phases.get(inst.id) == Phase.FALLING_ASLEEP:
                del self.phases[inst.id]
        self._metrics.sleep_wake_finished(self.spec.deployment, "sleep", ok=True)
        self._move(inst, S.SLEEPING, self._clock())
        log.info("instance %s asleep", inst.id)
        self._poke()  # the loop may want it awake again already

    def begin_wake(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        self.phases[inst.id] = Phase.WAKING
        self._spawn(self.turns, inst, self._wake_up(inst, self._clock()))

    async def _wake_up(self, inst: Instance, asked_at: float) -> None:
        try:
            await self._ops.wake(inst)
        except PoolError as exc:
            self._metrics.sleep_wake_finished(self.spec.deployment, "wake", ok=False)
            self.fail(inst, f"wake-up failed: {exc}", "wake")
            return
        finally:
            if self.phases.get(inst.id) == Phase.WAKING:
                del self.phases[inst.id]
        self._metrics.sleep_wake_finished(self.spec.deployment, "wake", ok=True)
        self._became_ready(inst, Tier.WAKE, asked_at)
        log.info("instance %s awake after %.2fs", inst.id, self._clock() - asked_at)

    async def drain(self, inst: Instance, grace_s: float) -> None:
        """Out of the routing set, let in-flight requests finish within `grace_s`, then stop. A
        sleeping instance has none: it is stopped at once."""
        if inst.state in (S.READY, S.SLEEPING):
            was_ready = inst.state == S.READY
            self._move(inst, S.DRAINING, self._clock())
            if was_ready:
                self.demand.capacity_changed()
                deadline = self._clock() + grace_s
                # A bounded poll of the activator's counter: 50 ms of latency on a drain costs nothing.
                while self.demand.load().outstanding.get(inst.id, 0) > 0 and self._clock() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        await self._forget(inst, to=S.STOPPED)

    async def _forget(self, inst: Instance, to: InstanceState | None = None) -> int | None:
        """Stop the instance's engine and drop it from the pool; its exit status where the backend
        knows it."""
        code = await self._ops.stop(inst)
        if to is not None and inst.state != to:
            self._move(inst, to, self._clock())
        self.phases.pop(inst.id, None)
        self.instances.pop(inst.id, None)
        self._recycler.forget(inst.id)
        self.account(self._clock())
        return code

    def _spawn(self, tasks: dict[str, asyncio.Task], inst: Instance, work) -> None:
        task = asyncio.create_task(work, name=f"{work.__name__}-{inst.id}")
        tasks[inst.id] = task
        task.add_done_callback(lambda t: tasks.pop(inst.id, None) if tasks.get(inst.id) is t else None)

    def _failed_start(self, now: float) -> None:
        self._failures += 1
        self._metrics.restarted(self.spec.deployment)
        self._not_before = now + restart_delay(self._failures - 1)
        self._poke()

    # ---- closing -------------------------------------------------------------------------------------

    async def halt(self, *also: asyncio.Future) -> None:
        """Cancel the starts, sleeps and wakes in flight, and wait for them, for the drains and stops
        in flight, and for `also`."""
        for task in [*self.launches.values(), *self.turns.values()]:
            task.cancel()
        await asyncio.gather(
            *self.launches.values(), *self.turns.values(), *self.stops.values(), *also, return_exceptions=True
        )

    async def close(self, grace_s: float | None) -> None:
        """Stop every instance, sleeping ones too, draining within `grace_s`; with None the READY
        and SLEEPING ones run on, for the next controller to adopt."""
        await self.sleep_states.aclose()
        await self._ops.close()
        self.phases.clear()
        if grace_s is not None:
            live = [i for i in self.instances.values() if i.state != S.STOPPED]
            if live:
                log.info(
                    "pool %s: stopping %d instance(s), %gs of grace", self.spec.deployment, len(live), grace_s
                )
            await asyncio.gather(*(self.drain(i, grace_s) for i in live), return_exceptions=True)
        self.account(self._clock())

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _move(self, inst: Instance, new: InstanceState, now: float) -> None:
        left, seconds = inst.move_to(new, now)
        self._metrics.add_instance_seconds(self.spec.deployment, left, seconds)
        self._metrics.set_instances(self.name, self._state_counts())
        if self._fleet is not None and inst.device is not None and new in (S.SLEEPING, S.STOPPED, S.READY):
            self._fleet.changed()  # memory came free (or a wake finished): pools waiting may go

    def account(self, now: float) -> None:
        for inst in self.instances.values():
            state, seconds = inst.accrue(now)
            self._metrics.add_instance_seconds(self.spec.deployment, state, seconds)
        self._metrics.set_instances(self.name, self._state_counts())

    def _state_counts(self) -> dict[InstanceState, int]:
        counts = dict.fromkeys(S, 0)
        for inst in self.instances.values():
            counts[inst.state] += 1
        return counts
