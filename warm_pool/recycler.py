"""The pool's recycler, a collaborator of `warm_pool.pool.Pool` around the pure steps of
`warm_pool.recycle`: when each instance was READY first, the recycle under way, and the census the
decision and the plan see while one is (the old instance left out: it serves, but is not counted).

The pool calls it at two points of a tick: `begin` while it observes (the census the decision
sees), and `settle` once the fleet has granted the decision (the census the plan gets, and the old
instance to retire once its replacement is READY). Around the grant, `wish` and `granted` count
the old instance in what the fleet is asked for: it holds memory while its replacement comes up.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

from warm_pool import recycle
from warm_pool.census import Census
from warm_pool.metrics import PoolMetrics
from warm_pool.policies.base import Decision

log = logging.getLogger("stoker.pool")


class Recycler:
    def __init__(self, name: str, deployment: str, metrics: PoolMetrics) -> None:
        self._name, self._deployment, self._metrics = name, deployment, metrics
        self._state = recycle.RecycleState()  # the recycle under way
        self._ready_at: dict[str, float] = {}  # instance id -> when it was READY first (the pool's clock)

    def first_ready(self, instance_id: str, now: float) -> None:
        self._ready_at.setdefault(instance_id, now)

    def forget(self, instance_id: str) -> None:
        self._ready_at.pop(instance_id, None)

    def age_of(self, instance_id: str, now: float) -> float | None:
        """Seconds since the instance was READY first; None if it never was."""
        at = self._ready_at.get(instance_id)
        return None if at is None else max(0.0, now - at)

    def recycling(self) -> str | None:
        """The instance being replaced now, if any."""
        current = self._state.current
        return current.old if current is not None else None

    def begin(
        self, census: Census, last: Decision | None, leaving: Collection[str], now: float, max_age_s: float
    ) -> Census:
        """Step 1 (`recycle.begin`): the census the decision sees, without the instance being
        replaced, if a recycle is (or now comes) under way. `leaving`: instances being stopped."""
        config = recycle.RecycleConfig(max_age_s) if max_age_s else None
        if config is None and self._state.current is None:
            return census
        routing = [
            recycle.Aged(i.id, self._ready_at[i.id])
            for i in census.routing
            if i.id in self._ready_at and i.id not in leaving
        ]
        if config is None:  # switched off while one was under way: it is called off
            self._state = recycle.RecycleState()
            self._metrics.recycled(self._deployment, "called_off")
            return census
        began = self._state.current
        self._state, outcome = recycle.begin(
            routing, last.ready if last is not None else None, self._state, now, config
        )
        if outcome is not None:
            log.info("pool %s: recycle of %s %s", self._name, began.old if began else "?", outcome)
            self._metrics.recycled(self._deployment, outcome)
        old = self.recycling()
        if old is None:
            return census
        return replace(census, routing=tuple(i for i in census.routing if i.id != old))

    def wish(self, decision: Decision) -> Decision:
        """What the fleet is asked for: the old instance holds memory too while its replacement
        comes up, and the arbiter counts every instance that does."""
        return replace(decision, ready=decision.ready + 1) if self.recycling() else decision

    def granted(self, granted: Decision) -> Decision:
        return replace(granted, ready=max(0, granted.ready - 1)) if self.recycling() else granted

    def settle(
        self, full: Census, census: Census, wanted: int, granted: int, now: float, max_age_s: float
    ) -> tuple[Census, str | None]:
        """Step 3 (`recycle.settle`): retire the old instance once replaced (the pool drains it with
        the grace period, as a scale-down drains), or call the recycle off. The census the plan
        gets, and the instance to retire, if any."""
        old = self.recycling()
        if old is None or not max_age_s:
            return census, None
        config = recycle.RecycleConfig(max_age_s)
        settled = recycle.settle(self._state, len(census.routing), wanted, granted, now, config)
        self._state = settled.state
        if settled.outcome is not None:
            log.info("pool %s: recycle of %s: %s", self._name, old, settled.outcome)
            self._metrics.recycled(self._deployment, settled.outcome)
        elif (current := settled.state.current) is not None and current.since == now:
            log.info("pool %s: instance %s is past its age: replacing it", self._name, old)
        if settled.retire is not None:
            return census, settled.retire
        return (census if self.recycling() else full), None
