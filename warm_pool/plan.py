"""The apply step as a pure function: a policy's `Decision` and the instances → the actions to take.

`plan(decision, census, can_sleep=..., may_start=..., outstanding=...)` returns the actions in the
order the live pool carries them out (`Pool._apply`); it reads no clock and does no I/O.

- More READY than routing + coming + waking: take back instances waiting to go to sleep (they have
  not slept yet), count those falling asleep as on their way back (the loop wakes them once they
  are asleep, which beats a new process), wake sleepers newest first, start the rest if `may_start`
  (no backoff, no corrupt snapshot).
- Fewer: cancel starts newest first, then the least busy READY instances (fewest outstanding
  requests, newest first on a tie) go to sleep while fewer sleep than asked (and the engine can
  sleep), or are drained with the grace period.
- Then sleepers beyond what is asked, counted after the actions above, are stopped, the longest
  asleep first. Worked example: 3 asleep, 1 READY put to sleep, decision.sleeping = 2 → 4 - 2 = 2
  stopped, the two asleep longest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from warm_pool.census import Census


@dataclass(frozen=True)
class TakeBack:
    id: str


@dataclass(frozen=True)
class Wake:
    id: str


@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Sleep:
    id: str


@dataclass(frozen=True)
class Drain:
    """Out of routing, its requests given `grace` (True) or none (a sleeper: stopped at once)."""

    id: str
    grace: bool = field(default=True)


Action = TakeBack | Wake | Start | Cancel | Sleep | Drain


def plan(
    ready: int,
    sleeping: int,
    census: Census,
    *,
    can_sleep: bool,
    may_start: bool,
    outstanding: Mapping[str, int],
) -> list[Action]:
    """The actions that bring `census` to `ready` READY and `sleeping` sleeping (see the module)."""
    actions: list[Action] = []
    active = len(census.routing) + len(census.coming) + len(census.waking)
    sleepers = census.sleeping
    woken: set[str] = set()
    if ready > active:
        need = ready - active
        for m in census.to_sleep[:need]:
            actions.append(TakeBack(m.id))
            sleepers -= 1
            need -= 1
        need -= min(need, len(census.falling))
        for m in sorted(census.asleep, key=lambda m: m.created_at, reverse=True)[:need]:
            actions.append(Wake(m.id))
            woken.add(m.id)
            sleepers -= 1
            need -= 1
        if need > 0 and may_start:
            actions.extend(Start() for _ in range(need))
    elif ready < active:
        surplus = active - ready
        for m in sorted(census.coming, key=lambda m: m.created_at, reverse=True)[:surplus]:
            actions.append(Cancel(m.id))
            surplus -= 1
        for m in sorted(census.routing, key=lambda m: (outstanding.get(m.id, 0), -m.created_at))[:surplus]:
            # can_sleep: the rules ask no sleep of an engine without sleep mode; this holds even if not.
            if can_sleep and sleepers < sleeping:
                actions.append(Sleep(m.id))
                sleepers += 1
            else:
                actions.append(Drain(m.id))
    asleep = [m for m in census.asleep if m.id not in woken]
    for m in sorted(asleep, key=lambda m: m.state_since)[: max(0, sleepers - sleeping)]:
        actions.append(Drain(m.id, grace=False))
    return actions
