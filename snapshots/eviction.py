"""Which snapshots to evict: pure decisions over one observation of the store.

The store observes (sizes, last uses, pins, free disk) and applies (renames snapshots away); these
functions only decide, so a table of cases pins every rule down without a disk. The rules:

- Least recently used goes first; ties by id, so two processes decide alike.
- A pinned snapshot is never chosen, however old.
- All or nothing: when evicting every unpinned snapshot would still not make room, nothing is
  chosen and the plan says why. Emptying the store and then failing anyway would cost every other
  model a re-download and buy nothing.
- Room means both: the store stays within its byte budget, and the disk keeps `reserve` bytes free
  after the write (a full disk fails writers that are not ours too: logs, the registry).

Worked example: budget 1000 B, snapshots A (400 B, used at t=1), B (300 B, t=3, pinned), C (200 B,
t=2); storing 150 B more needs 400 + 300 + 200 + 150 - 1000 = 50 B freed, so A goes, although C is
smaller and would do: LRU, not best fit, because the oldest is the least likely to be wanted next.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from snapshots.sizes import format_size


@dataclass(frozen=True)
class Stored:
    """What the decision needs to know about one stored snapshot."""

    id: str
    bytes: int
    last_used: float  # epoch seconds
    pinned: bool


@dataclass(frozen=True)
class Plan:
    """Evict `evict`, in that order; or, when `problem` is set, evict nothing: it cannot be done."""

    evict: tuple[str, ...] = ()
    problem: str | None = None


def lru_order(snapshots: Iterable[Stored]) -> list[Stored]:
    """The unpinned snapshots, least recently used first."""
    return sorted((s for s in snapshots if not s.pinned), key=lambda s: (s.last_used, s.id))


def _choose(snapshots: Iterable[Stored], need: int) -> tuple[str, ...]:
    chosen: list[str] = []
    freed = 0
    for s in lru_order(snapshots):
        if freed >= need:
            break
        chosen.append(s.id)
        freed += s.bytes
    return tuple(chosen)


def plan_room(
    snapshots: Iterable[Stored], nbytes: int, *, budget: int | None, free: int, reserve: int
) -> Plan:
    """What to evict before writing `nbytes` of new snapshot data."""
    snapshots = list(snapshots)
    stored = sum(s.bytes for s in snapshots)
    pinned = [s for s in snapshots if s.pinned]
    pinned_bytes = sum(s.bytes for s in pinned)
    evictable = stored - pinned_bytes
    over_budget = stored + nbytes - budget if budget is not None else 0
    short_on_disk = nbytes + reserve - free
    need = max(over_budget, short_on_disk, 0)
    if need == 0:
        return Plan()
    held = f"{len(pinned)} pinned snapshot(s) in use hold {format_size(pinned_bytes)}"
    if budget is not None and nbytes > budget:
        return Plan(
            problem=f"{format_size(nbytes)} of new snapshot data is more than the whole snapshot "
            f"budget of {format_size(budget)}"
        )
    if over_budget > evictable:
        return Plan(
            problem=f"no room for {format_size(nbytes)} within the snapshot budget of "
            f"{format_size(budget or 0)}: {held}, and evicting every unpinned one would free only "
            f"{format_size(evictable)}"
        )
    if short_on_disk > evictable:
        return Plan(
            problem=f"no room for {format_size(nbytes)} on disk: {format_size(max(free, 0))} free "
            f"(keeping {format_size(reserve)} spare); {held}, and evicting every unpinned one would free "
            f"only {format_size(evictable)}"
        )
    return Plan(evict=_choose(snapshots, need))


def plan_budget(snapshots: Iterable[Stored], budget: int) -> Plan:
    """What to evict to bring the store down to `budget`, as far as pins allow.

    Unlike `plan_room` this goes as far as it can: gc frees what is free to go even when pinned
    snapshots alone keep the store over budget, and says so in `problem`.
    """
    snapshots = list(snapshots)
    need = sum(s.bytes for s in snapshots) - budget
    if need <= 0:
        return Plan()
    evict = _choose(snapshots, need)
    chosen = set(evict)
    left = sum(s.bytes for s in snapshots if s.id not in chosen)
    if left <= budget:
        return Plan(evict=evict)
    pinned_bytes = sum(s.bytes for s in snapshots if s.pinned)
    return Plan(
        evict=evict,
        problem=f"still {format_size(left)}, over the budget of {format_size(budget)}: pinned snapshots "
        f"in use hold {format_size(pinned_bytes)}",
    )
