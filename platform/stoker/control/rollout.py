"""How traffic moves between a deployment's revisions: updates warm before they switch, splits,
rollbacks, and canaries that roll themselves back.

An update to another model or engine (`switch_to`):

    new revision's unit starts with min_warm = READY instances the live revisions have now
      ──READY that many (0: at once)──▶ all traffic to it ──▶ each old unit retires:
         its held requests are answered first, then its instances drain (grace period) and stop

A new revision that the running instances can serve as they are (the same snapshot and engine:
only settings differ) takes over in place, at once. A start that keeps failing leaves the traffic
where it was and marks the revision failed. A newer update supersedes one still warming.

A split (`split`) gives revisions whole percents; a revision given traffic that has no instances
gets a unit, cold (its first requests are held while it starts). A rollback (`rollback_target` +
`switch_to`) is an update to an earlier revision's exact snapshot and settings.

Canaries: every `check_interval_s` the newest revision holding part of the traffic, if its settings
ask for `auto_rollback`, is judged (`stoker.gateway.revisions.canary_verdict`); a failed one loses its
share to the others and is retired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from activator import Balance
from stoker.control.deployment import Deployment, Unit
from stoker.errors import APIError, invalid
from stoker.gateway.revisions import canary_verdict
from stoker.spec.deployment import DeploymentSpec
from stoker.spec.traffic import parse_traffic

if TYPE_CHECKING:
    from activator import Activator
    from stoker.control.cluster import RoutingTable
    from stoker.control.registry import Registry
    from stoker.gateway.revisions import RevisionMetrics
    from warm_pool.backends.base import Running
    from warm_pool.policies.base import ScalingConfig


class Units(Protocol):
    """What a rollout needs of whoever owns the deployments and makes their units (the platform:
    `stoker.control.platform.Platform`). Declared here, by its consumer."""

    clock: Callable[[], float]
    registry: Registry
    routes: RoutingTable
    revision_metrics: RevisionMetrics
    hold_deadline_s: float
    unavailable_after: int  # failed starts in a row before held requests hear why (0: never)

    def list(self) -> list[Deployment]: ...

    def scaling(self, spec: DeploymentSpec, min_warm: int | None = None) -> ScalingConfig: ...

    def max_instance_age(self, spec: DeploymentSpec) -> float: ...

    def check_snapshot(self, spec: DeploymentSpec) -> None: ...

    def new_unit(
        self, spec: DeploymentSpec, adopt: list[Running] = (), min_warm: int | None = None
    ) -> Unit: ...

    async def stop_unit(self, unit: Unit) -> None: ...

    def pool_gone(self, unit: Unit) -> None: ...


log = logging.getLogger("stoker.rollout")
FAILED_STARTS = 3  # starts in a row that fail a warming revision (when the pool's own bound is off)
# A revision that has not warmed in this long has failed, even with no start failing: e.g. shared
# devices with no room for it, its starts forever waiting. Its traffic stays where it was.
WARM_TIMEOUT_S = 900.0


class _Failed(Exception):
    pass


class Rollout:
    def __init__(
        self,
        platform: Units,
        *,
        check_interval_s: float = 1.0,
        poll_s: float = 0.05,
        warm_timeout_s: float = WARM_TIMEOUT_S,
    ) -> None:
        self._p = platform
        self._interval = check_interval_s
        self._poll = poll_s
        self._warm_timeout = warm_timeout_s
        self._watch: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._watch = asyncio.create_task(self._watch_canaries(), name="canaries")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for d in self._p.list():
            await self.cancel(d)

    async def cancel(self, d: Deployment) -> None:
        """Stop moving `d`'s traffic: a switch under way ends (its unit stays, for the caller to
        stop), and units retiring stop now, without waiting for their held requests."""
        d.closing = True
        if d.switch is not None:
            d.switch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await d.switch
        await asyncio.gather(*d.leaving.values(), return_exceptions=True)

    # ---- what the platform asks ----------------------------------------------------------------

    def configure(self, activator: Activator, spec: DeploymentSpec) -> None:
        """The revision's request-path settings on its activator."""
        activator.set_balance(balance_of(spec))
        activator.set_engine_priority(spec.engine_settings.takes_priority(spec.engine))

    def publish(self, d: Deployment, traffic: dict[int, int] | None) -> None:
        """`traffic` (None: as it is) in force: in memory, in the registry, in the metrics."""
        if traffic is not None:
            d.traffic = dict(traffic)
            self._p.registry.set_traffic(d.name, d.traffic)
        known = sorted({*d.units, *d.traffic, *(r for r in d.notes)})
        self._p.revision_metrics.set_traffic(d.name, d.traffic, known)
        self._p.routes.bump()

    def switch_to(self, d: Deployment, spec: DeploymentSpec, percent: int = 100) -> None:
        """`percent` of `d`'s traffic (all of it, or a canary's share) to revision `spec`: all of it
        in place if the primary's instances can serve it, else once its own instances are READY
        (in the background)."""
        if d.switch is not None:
            d.switch.cancel()  # superseded: its unit retires (in `_switch`)
            d.switch = None
        primary = d.primary
        if percent == 100 and spec.serves_like(primary.spec) and spec.revision not in d.units:
            d.units.pop(primary.spec.revision)
            primary.spec = spec
            d.units[spec.revision] = primary
            primary.pool.reconfigure(self._p.scaling(spec), spec.policy)
            primary.pool.spec = replace(
                primary.pool.spec,
                grace_period_s=spec.grace_period_s,
                max_instance_age_s=self._p.max_instance_age(spec),
            )
            if primary.activator is not None:
                self.configure(primary.activator, spec)
            self._take_all(d, spec.revision)
            return
        d.notes[spec.revision] = "warming"
        self._p.registry.set_pending_switch(d.name, (spec.revision, percent))
        d.switch = asyncio.create_task(
            self._switch(d, spec, percent), name=f"switch-{d.name}@{spec.revision}"
        )

    def resume(self, d: Deployment, running: list[Running]) -> list[Running]:
        """A switch a previous run began and did not end (the registry's `pending_switch`: a
        controller killed while a canary warmed) begins again, adopting the engines it had
        started. The engines left unclaimed are returned."""
        registry = self._p.registry
        pending = registry.pending_switch(d.name)
        if pending is None:
            return running
        r, percent = pending
        spec = registry.revision(d.name, r)
        if spec is None or d.traffic.get(r, 0) >= percent:
            registry.set_pending_switch(d.name, None)  # it ended before the restart
            return running
        try:
            self._p.check_snapshot(spec)
        except APIError as exc:
            log.error("deployment %s: the switch to revision %d not resumed: %s", d.name, r, exc.message)
            registry.set_pending_switch(d.name, None)
            return running
        mine = [x for x in running if (x.deployment, x.snapshot_id) == (d.name, spec.snapshot_id)]
        if r not in d.units:
            d.units[r] = self._p.new_unit(spec, adopt=mine)
        log.info("deployment %s: resuming the switch of %d%% to revision %d", d.name, percent, r)
        self.switch_to(d, spec, percent)
        return [x for x in running if x not in mine]

    def split(self, d: Deployment, body: object, history: list[tuple[DeploymentSpec, float]]) -> None:
        """`stoker traffic`: percents per revision; it overrides a switch under way."""
        specs = {spec.revision: spec for spec, _ in history}
        traffic = parse_traffic(body, set(specs))
        for r in traffic:
            if r not in d.units:
                self._p.check_snapshot(specs[r])
        if d.switch is not None:
            d.switch.cancel()
            d.switch = None
        for r in traffic:
            d.notes.pop(r, None)
            if r in d.leaving:
                raise APIError(
                    409,
                    f"Revision {r} is draining; give it traffic again once it is gone.",
                    param="traffic",
                    code="revision_draining",
                )
            if r not in d.units:
                d.units[r] = self._p.new_unit(specs[r])
        self.publish(d, traffic)
        for r in list(d.units):
            if r not in traffic:
                self._retire(d, r)

    def rollback_target(
        self, d: Deployment, to: int | None, history: list[tuple[DeploymentSpec, float]]
    ) -> DeploymentSpec:
        specs = {spec.revision: spec for spec, _ in history}
        if to is not None:
            if isinstance(to, bool) or not isinstance(to, int) or to not in specs:
                raise invalid(f"'to' must be one of the revisions {sorted(specs)}, got {to!r}.", "to")
            return specs[to]
        if len(d.traffic) > 1:  # a canary: back to the revision that held the most besides it
            newest = max(d.traffic)
            return specs[max((r for r in d.traffic if r != newest), key=lambda r: (d.traffic[r], r))]
        current = d.primary.spec.revision
        earlier = [r for r in specs if r < current and not d.notes.get(r, "").startswith("failed")]
        if not earlier:
            raise APIError(
                409,
                f"Deployment {d.name!r} has no revision before {current} to roll back to.",
                param="to",
                code="no_previous_revision",
            )
        return specs[max(earlier)]

    # ---- moving traffic ------------------------------------------------------------------------

    async def _switch(self, d: Deployment, spec: DeploymentSpec, percent: int) -> None:
        r = spec.revision
        try:
            if (leaving := d.leaving.get(r)) is not None:
                # Back to a revision still draining (a rollback right after its switch): its unit
                # is being stopped, so a fresh one once it is gone (waited for, never cancelled).
                log.info("deployment %s: revision %d is draining; warming it again once it has", d.name, r)
                await asyncio.wait({leaving})
            # READY capacity for its share of what the live revisions serve now.
            live = sum(u.ready for rv, u in d.units.items() if d.traffic.get(rv) and rv != r)
            need = min(spec.max, math.ceil(live * percent / 100))
            unit = d.units.get(r)
            if unit is None:
                unit = d.units[r] = self._p.new_unit(spec, min_warm=need)
            else:
                unit.pool.reconfigure(self._p.scaling(spec, need), spec.policy)
            log.info("deployment %s: revision %d warming %d instance(s) before the switch", d.name, r, need)
            await self._until_ready(unit, need)
        except _Failed as exc:
            log.error("deployment %s: revision %d failed to warm: %s; traffic stays", d.name, r, exc)
            d.notes[r] = f"failed: {exc}"
            d.switch = None
            self._ended(d, r, percent)
            if not d.traffic.get(r):
                self._retire(d, r)
            return
        except asyncio.CancelledError:
            if not d.closing:  # superseded or overridden; a controller stopping leaves it to resume
                self._ended(d, r, percent)
            if d.notes.get(r) == "warming":
                d.notes.pop(r)
            if not d.traffic.get(r) and r in d.units and not d.closing:
                self._retire(d, r)
            raise
        d.notes.pop(r, None)
        d.switch = None
        unit.pool.reconfigure(self._p.scaling(spec), spec.policy)
        log.info("deployment %s: revision %d takes %d%% of the traffic", d.name, r, percent)
        if percent == 100:
            self._take_all(d, r)
        else:
            rest = _to_100({rv: p for rv, p in d.traffic.items() if rv != r}, 100 - percent)
            self.publish(d, {**rest, r: percent})
        self._ended(d, r, percent)

    def _ended(self, d: Deployment, r: int, percent: int) -> None:
        """The switch to `r` is over (done, failed or overridden): none to resume, unless a newer
        one was recorded meanwhile."""
        if self._p.registry.pending_switch(d.name) == (r, percent):
            self._p.registry.set_pending_switch(d.name, None)

    async def _until_ready(self, unit: Unit, need: int) -> None:
        bound = self._p.unavailable_after or FAILED_STARTS
        deadline = self._p.clock() + self._warm_timeout
        while unit.ready < need:
            if self._p.clock() >= deadline:
                raise _Failed(f"{unit.ready} of {need} instance(s) READY after {self._warm_timeout:g}s")
            if unit.pool.unavailable is not None:
                raise _Failed(unit.pool.unavailable)
            if unit.pool.failed_starts >= bound:
                failure = unit.pool.last_failure
                raise _Failed(failure.reason if failure is not None else f"{bound} starts failed")
            await asyncio.sleep(self._poll)

    def _take_all(self, d: Deployment, r: int) -> None:
        self.publish(d, {r: 100})
        for other in list(d.units):
            if other != r:
                self._retire(d, other)

    def _retire(self, d: Deployment, r: int) -> None:
        """Take revision `r`'s unit away: its held requests answered first, then drained and stopped."""
        if r in d.leaving or r not in d.units:
            return
        d.leaving[r] = asyncio.create_task(self._leave(d, r, d.units[r]), name=f"retire-{d.name}@{r}")

    async def _leave(self, d: Deployment, r: int, unit: Unit) -> None:
        try:
            # No new request comes here (no traffic); those held wait for this unit's own capacity.
            deadline = self._p.clock() + self._p.hold_deadline_s
            while not d.closing and self._held(unit) and self._p.clock() < deadline:  # noqa: ASYNC110 (no event for it)
                await asyncio.sleep(self._poll)
            log.info("deployment %s: revision %d drains and stops", d.name, r)
            await self._p.stop_unit(unit)
        finally:
            if d.units.get(r) is unit:
                del d.units[r]
            d.leaving.pop(r, None)
            self._p.pool_gone(unit)
            self.publish(d, None)

    @staticmethod
    def _held(unit: Unit) -> bool:
        source = unit.activator if unit.activator is not None else unit.demand
        return source is not None and source.load().queued > 0

    # ---- canaries ------------------------------------------------------------------------------

    async def _watch_canaries(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            for d in self._p.list():
                try:
                    self._judge(d)
                except Exception:  # one deployment's trouble must not end the watch
                    log.exception("deployment %s: canary check failed", d.name)

    def _judge(self, d: Deployment) -> None:
        if len(d.traffic) < 2:
            return
        canary = max(d.traffic)
        unit = d.units.get(canary)
        if unit is None or not unit.spec.auto_rollback:
            return
        why = canary_verdict(d.stats.answers(canary), unit.spec, self._p.clock())
        if why is None:
            return
        rest = {r: p for r, p in d.traffic.items() if r != canary}
        log.warning("deployment %s: canary revision %d rolled back: %s", d.name, canary, why)
        d.notes[canary] = f"rolled back: {why}"
        self._p.revision_metrics.rollbacks.labels(d.name).inc()
        self.publish(d, _to_100(rest))
        self._retire(d, canary)


def canary_percent(body: object) -> int | None:
    """A deploy's `canary_percent`: the share the new revision takes once warm (the rest stays
    where it is); absent: all of it."""
    value = body.get("canary_percent") if isinstance(body, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise invalid(f"'canary_percent' must be a whole percent in 1..100, got {value!r}.", "canary_percent")
    return value


def balance_of(spec: DeploymentSpec) -> Balance:
    """How the revision's activator picks an instance (`activator.affinity`)."""
    return Balance(mode=spec.balance, bound=spec.affinity_bound)


def _to_100(traffic: dict[int, int], total: int = 100) -> dict[int, int]:
    """`traffic` scaled to sum to `total` in whole percents (largest remainders round up)."""
    have = sum(traffic.values())
    exact = {r: p * total / have for r, p in traffic.items()}
    out = {r: int(v) for r, v in exact.items()}
    for r in sorted(exact, key=lambda r: out[r] - exact[r])[: total - sum(out.values())]:
        out[r] += 1
    return out
