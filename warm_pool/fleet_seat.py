"""A pool's seat in the fleet (`warm_pool.fleet`), a mixin of `warm_pool.pool.Pool`: the wish it
hands the arbiter, the instances it holds device memory with, and its decision as granted."""

from __future__ import annotations

import logging
from dataclasses import replace

from warm_pool.arbiter import Wish
from warm_pool.census import Member, Phase
from warm_pool.policies.base import Decision
from warm_pool.pool_spec import LoadView
from warm_pool.states import Instance, InstanceState

log = logging.getLogger("stoker.pool")
S = InstanceState


class FleetSeat:
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
