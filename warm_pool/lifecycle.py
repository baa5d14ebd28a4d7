"""One instance's way through the pool, the pool's half of `warm_pool.pool.Pool` (a mixin: the
loop decides, this carries each instance through its states): start, adopt, sleep, wake, drain,
fail and be replaced, and the corrections its engine's own word on its sleep makes
(`warm_pool.reconcile`). The work on the engine itself is `warm_pool.instances`."""

from __future__ import annotations

import asyncio
import logging
import time

from snapshots import SnapshotError
from warm_pool.backends.base import Running, start_tier
from warm_pool.backoff import restart_delay
from warm_pool.census import Phase
from warm_pool.errors import PoolError, SnapshotCorrupt, StartFailed
from warm_pool.failures import record_of
from warm_pool.instances import Launch, unreachable
from warm_pool.metrics import split_cold_start
from warm_pool.policies.base import Tier
from warm_pool.reconcile import Correction, Observed, correction
from warm_pool.states import Instance, InstanceState

log = logging.getLogger("stoker.pool")
S = InstanceState


class Lifecycle:
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
            self._recycler.first_ready(
                inst.id, now
            )  # its age counts from its adoption: its start is unknown here
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
        self._recycler.first_ready(inst.id, now)
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
        self._recycler.forget(inst.id)
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
