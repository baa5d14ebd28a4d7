"""The pool's half of recycling (`warm_pool.recycle`), a mixin of `warm_pool.pool.Pool`: when each
instance was READY first, the recycle under way, and the census the decision and the plan see
while one is (the old instance left out: it serves, but is not counted)."""

from __future__ import annotations

import logging
from dataclasses import replace

from warm_pool import recycle
from warm_pool.census import Census
from warm_pool.policies.base import Decision
from warm_pool.states import Instance

log = logging.getLogger("stoker.pool")


class RecycleSeat:
    _recycle_state: recycle.RecycleState
    _ready_at: dict[str, float]  # instance id -> when it was READY first (the pool's clock)

    def _recycle_config(self) -> recycle.RecycleConfig | None:
        age = self.spec.max_instance_age_s
        return recycle.RecycleConfig(age) if age else None

    def _first_ready(self, inst: Instance, now: float) -> None:
        self._ready_at.setdefault(inst.id, now)

    def age_of(self, inst: Instance, now: float) -> float | None:
        """Seconds since the instance was READY first; None if it never was."""
        at = self._ready_at.get(inst.id)
        return None if at is None else max(0.0, now - at)

    def _recycling(self) -> str | None:
        """The instance being replaced now, if any."""
        current = self._recycle_state.current
        return current.old if current is not None else None

    def _recycle_census(self, census: Census, now: float) -> Census:
        """Step 1 (`recycle.begin`): the census the decision sees, without the instance being
        replaced, if a recycle is (or now comes) under way."""
        config = self._recycle_config()
        if config is None and self._recycle_state.current is None:
            return census
        routing = [
            recycle.Aged(i.id, self._ready_at[i.id])
            for i in census.routing
            if i.id in self._ready_at and i.id not in self._stops
        ]
        if config is None:  # switched off while one was under way: it is called off
            self._recycle_state = recycle.RecycleState()
            self._metrics.recycled(self.spec.deployment, "called_off")
            return census
        last = self.last_decision.ready if self.last_decision is not None else None
        began = self._recycle_state.current
        self._recycle_state, outcome = recycle.begin(routing, last, self._recycle_state, now, config)
        if outcome is not None:
            log.info("pool %s: recycle of %s %s", self.name, began.old if began else "?", outcome)
            self._metrics.recycled(self.spec.deployment, outcome)
        old = self._recycling()
        if old is None:
            return census
        return replace(census, routing=tuple(i for i in census.routing if i.id != old))

    def _recycle_wish(self, decision: Decision) -> Decision:
        """What the fleet is asked for: the old instance holds memory too while its replacement
        comes up, and the arbiter counts every instance that does."""
        return replace(decision, ready=decision.ready + 1) if self._recycling() else decision

    def _recycle_granted(self, granted: Decision) -> Decision:
        return replace(granted, ready=max(0, granted.ready - 1)) if self._recycling() else granted

    def _recycle_settle(self, full: Census, census: Census, wanted: int, granted: int, now: float) -> Census:
        """Step 3 (`recycle.settle`): retire the old instance once replaced (drained with the grace
        period, as a scale-down drains), or call the recycle off; the census the plan gets."""
        old = self._recycling()
        config = self._recycle_config()
        if old is None or config is None:
            return census
        settled = recycle.settle(self._recycle_state, len(census.routing), wanted, granted, now, config)
        self._recycle_state = settled.state
        if settled.outcome is not None:
            log.info("pool %s: recycle of %s: %s", self.name, old, settled.outcome)
            self._metrics.recycled(self.spec.deployment, settled.outcome)
        elif (current := settled.state.current) is not None and current.since == now:
            log.info("pool %s: instance %s is past its age: replacing it", self.name, old)
        if settled.retire is not None:
            inst = self._instances[settled.retire]
            self._spawn(self._stops, inst, self._drain(inst, self.spec.grace_period_s))
            return census
        return census if self._recycling() else full
