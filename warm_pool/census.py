"""The instances as the pure steps see them: one `Member` per instance, and a deployment's members
by group (`Census`), the shape the observation, the recycle, the fleet arbiter and the plan read, in
the live pool and the simulator alike.

A `Member` carries what any pure step reads of an instance, each step its own fields: the plan
(`warm_pool.plan`) its age (`created_at`: newest first when waking or cancelling) and how long it
has been in its state (`state_since`: the longest asleep are stopped first); the arbiter
(`warm_pool.arbiter`) its deployment, its device, whether it holds its awake footprint, whether it
has requests in flight (never evicted) and the bytes it holds where its deployment made no wish (a
warm runtime's). Fields a step does not read keep their defaults.

`census_of` groups a live pool's instances, each in exactly one group; DRAINING, FAILED and STOPPED
ones are in none. A `Phase` is where an instance is in a sleep or a wake: out of routing throughout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from warm_pool.states import Instance, InstanceState


@dataclass(frozen=True)
class Member:
    """One instance as the pure steps see it (see the module for who reads which field)."""

    id: str
    deployment: str = ""
    device: str = ""
    awake: bool = False  # STARTING/READY/waking (holds its awake footprint); else SLEEPING (the residual)
    busy: bool = False  # requests in flight on it: never evicted
    holds: int = 0  # bytes it holds now, counted where its deployment made no wish
    created_at: float = 0.0
    state_since: float = 0.0


@dataclass(frozen=True)
class Census:
    """A deployment's instances by group, each in exactly one (draining and failed ones in none)."""

    routing: tuple[Member, ...] = ()  # READY and taking requests
    coming: tuple[Member, ...] = ()  # PENDING or STARTING
    waking: tuple[Member, ...] = ()
    asleep: tuple[Member, ...] = ()  # SLEEPING, nothing in progress
    to_sleep: tuple[Member, ...] = ()  # out of routing, waiting for its requests before a sleep
    falling: tuple[Member, ...] = ()  # the sleep call in flight

    @property
    def sleeping(self) -> int:
        """Asleep or on the way: what the observation and the decision call sleeping."""
        return len(self.asleep) + len(self.to_sleep) + len(self.falling)


class Phase(StrEnum):
    """Where an instance is in a sleep or wake; it is out of the routing set throughout."""

    TO_SLEEP = "to_sleep"  # READY, waiting for its requests to finish; may still be taken back
    FALLING_ASLEEP = "falling_asleep"  # READY, `POST /sleep` in flight
    WAKING = "waking"  # SLEEPING, `POST /wake_up` in flight


S = InstanceState
BY_PHASE = {Phase.TO_SLEEP: "to_sleep", Phase.FALLING_ASLEEP: "falling", Phase.WAKING: "waking"}
BY_STATE = {S.READY: "routing", S.PENDING: "coming", S.STARTING: "coming", S.SLEEPING: "asleep"}


def census_of(instances: Iterable[Instance], phases: Mapping[str, Phase]) -> Census:
    """A live pool's instances by group: a phase first (a sleep or wake under way), else the state."""
    groups: dict[str, list[Member]] = {name: [] for name in Census.__dataclass_fields__}
    for inst in instances:
        phase = phases.get(inst.id)
        group = BY_PHASE[phase] if phase is not None else BY_STATE.get(inst.state)
        if group is not None:
            groups[group].append(Member(inst.id, created_at=inst.created_at, state_since=inst.state_since))
    return Census(**{name: tuple(members) for name, members in groups.items()})
