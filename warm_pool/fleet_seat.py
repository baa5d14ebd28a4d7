"""A pool's seat in the fleet (`warm_pool.fleet`), a collaborator of `warm_pool.pool.Pool`: the wish
it hands the arbiter, the instances it holds device memory with, and its decision as granted (the
arbitrate-and-fit stage of a tick: `arbiter.arbitrate`, then `arbiter.fits_now`, run by the fleet)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import replace

from warm_pool.arbiter import Wish
from warm_pool.census import Member, Phase
from warm_pool.fleet import Fleet, Footprint
from warm_pool.policies.base import Decision
from warm_pool.pool_spec import LoadView
from warm_pool.states import Instance, InstanceState

log = logging.getLogger("stoker.pool")
S = InstanceState


class FleetSeat:
    def __init__(self, name: str, fleet: Fleet) -> None:
        self.name, self._fleet = name, fleet
        self.wish: Wish | None = None  # the latest, for the fleet's arbiter
        self._last_grant = ""  # how the fleet last changed a decision, as logged
        self._outstanding: Mapping[str, int] = {}  # requests in flight per instance, at the last tick
        self._held_since: float | None = None  # the first tick of the current spell with requests held

    def arbitrate(
        self,
        decision: Decision,
        load: LoadView,
        footprint: Footprint,
        horizon_s: float,
        now: float | None = None,
    ) -> tuple[Decision, tuple[str, ...]]:
        """The decision as the fleet grants it, and the devices its starts go on. `now` (the pool's
        clock, shared by every pool of the fleet) dates the requests held: the arbiter serves the
        deployment held longest first. The date is the first tick of the spell with requests held
        (a held request pokes the pool at once, so that tick is the oldest's arrival); it lasts
        until nothing is held, so a deployment held throughout keeps its place in the line."""
        self._outstanding = dict(load.outstanding)
        if load.queued <= 0 or now is None:
            self._held_since = None
        elif self._held_since is None:
            self._held_since = now
        self.wish = Wish(
            self.name,
            decision.ready,
            decision.sleeping,
            footprint.awake,
            footprint.asleep,
            rate=decision.forecast or 0.0,
            horizon_s=horizon_s,
            held=load.queued,
            held_since=self._held_since if self._held_since is not None else math.inf,
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

    def members(
        self, instances: Iterable[Instance], phases: Mapping[str, Phase], footprint: Footprint
    ) -> list[Member]:
        """Every instance that holds device memory: awake unless SLEEPING with no wake under way. The
        sleepers come last, newest first (by creation): the order `warm_pool.plan` wakes them in, so the
        arbiter and `arbiter.fits_now` check the device of the sleeper that is then woken."""
        awake_ones, sleepers = [], []
        for i in instances:
            if i.device is None or i.state == S.STOPPED:
                continue
            awake = i.state != S.SLEEPING or phases.get(i.id) == Phase.WAKING
            holds = footprint.awake if awake else footprint.asleep
            m = Member(
                i.id,
                self.name,
                i.device,
                awake,
                self._outstanding.get(i.id, 0) > 0,
                holds,
                created_at=i.created_at,
            )
            (awake_ones if awake else sleepers).append(m)
        return awake_ones + sorted(sleepers, key=lambda m: m.created_at, reverse=True)
