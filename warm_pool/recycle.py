"""Recycling without a dip: an instance READY for longer than the deployment's maximum age
(`stoker up --max-instance-age`, `stoker deploy --max-instance-age`) is replaced by a fresh one,
the fresh one READY first, then the old one drained. A pure decision beside the policies; the
pool carries it out (`warm_pool.recycler`).

Why recycle at all: a long-lived engine process accumulates what a fresh one has not (allocator
fragmentation, a slow leak, a KV cache that never shrinks back, credentials and certificates read
at start). Replacing it on a schedule bounds all of them, as Kubernetes' descheduler
(`PodLifeTime`) and uWSGI's `max-worker-lifetime` do; here without ever serving from fewer READY
instances than before, since a start costs seconds and a request held meanwhile would notice.

One recycle at a time per pool, in three steps:

1. Begin (`begin`, before the policy decides): when none is under way, the pool is not scaling
   down (the last decision asked for at least as many READY as route now), and a READY instance in
   routing is due, the most overdue one becomes the old one. Due: READY first at r, due at
   r + max_age × (1 − jitter × u), u in [0, 1) from a hash of its id (`due_at`): instances that
   came up together (a burst) are due up to `jitter` (10 %) of the age apart instead of at once,
   and each is still replaced before it is max_age old (give or take the replacement's start).
   Worked example: max age 1 h, two instances READY at the same second, u = 0.12 and 0.83: due
   3600 × (1 − 0.1 × u) s later, at 59 m 17 s and 55 m 1 s: the second first, then the first,
   four minutes apart.
2. Replace (the pool): the old one stays in routing, serving, but the policy and the plan do not
   count it, so they ask for a replacement as they would for any missing instance: a sleeper
   woken (newest first), else a fresh start. READY + starting is then at most the deployment's
   max + 1, one instance above its bound for one start-up time. Under a fleet (shared device
   memory) the wish carries the old one too, so the arbiter (`warm_pool.arbiter`) grants the
   replacement only where its memory fits; when it does not the recycle waits, counted once
   (`no_room`), and the old instance serves on.
3. Settle (`settle`, after the decision): once the other READY instances are at least as many as
   routed when it began (`before`) and as many as the decision grants, the old one is retired:
   out of routing, its requests given the grace period, stopped, exactly as a scale-down drains
   one. If the policy meanwhile asks for fewer than `before`, the recycle is called off (the pool
   is scaling down; the old one rejoins the count and may be the one to go) and none begins for
   `retry_s`. A recycle called off on the call that began it asked for nothing and is not
   counted: a policy may answer differently once the old instance is not counted (predictive, idle,
   plans a sleep where an instance is gone), and then nothing was recycled. If the old one leaves routing by other means (it died, an engine was found asleep),
   the recycle ends as `lost`.

The counted outcomes (`stoker_instance_recycles_total{deployment,outcome}`): `replaced`,
`called_off`, `lost`, and `no_room` (a recycle that had to wait for device memory; it then ends
with one of the others).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from warm_pool.errors import InvalidConfig

MIN_MAX_AGE_S = 10.0  # a younger maximum age would recycle instances faster than many start
OUTCOMES = ("replaced", "called_off", "lost", "no_room")


def max_age_error(value: object, *, allow_zero: bool = False) -> str | None:
    """Why `value` is no maximum instance age (None: it is one); 0 means off where allowed."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value >= MIN_MAX_AGE_S or (allow_zero and value == 0)):
        return None
    off = "0 (off) or " if allow_zero else ""
    return f"must be {off}at least {MIN_MAX_AGE_S:g}s, got {value!r}"


@dataclass(frozen=True)
class RecycleConfig:
    max_age_s: float
    jitter: float = 0.1  # instances of the same age are due up to this share of max_age_s apart
    retry_s: float = 30.0  # after a recycle is called off, none begins for this long

    def __post_init__(self) -> None:
        if (message := max_age_error(self.max_age_s)) is not None:
            raise InvalidConfig("max_age_s", f"max_age_s {message}")
        if not 0 <= self.jitter < 1:
            raise InvalidConfig("jitter", f"jitter must be in [0, 1), got {self.jitter!r}")
        if not (math.isfinite(self.retry_s) and self.retry_s >= 0):
            raise InvalidConfig("retry_s", f"retry_s must be a finite number ≥ 0, got {self.retry_s!r}")


class Aged(NamedTuple):
    """A READY instance in routing, and when it was READY first (the pool's clock)."""

    id: str
    ready_at: float


@dataclass(frozen=True)
class Recycle:
    old: str  # the instance being replaced: it serves until its replacement is READY
    since: float
    before: int  # READY instances in routing when it began: never fewer until it is retired
    waited: bool = False  # counted once as waiting for device memory


@dataclass(frozen=True)
class RecycleState:
    current: Recycle | None = None
    not_before: float = -math.inf  # no recycle begins before this (after one was called off)


class Settled(NamedTuple):
    state: RecycleState
    retire: str | None  # drain this instance now: its replacement is READY
    outcome: str | None  # what to count, if anything


def due_at(instance_id: str, ready_at: float, config: RecycleConfig) -> float:
    """When an instance READY first at `ready_at` is due: max_age early by up to `jitter`, by a
    fraction fixed by its id (the same answer every call, no randomness handed in)."""
    u = int.from_bytes(hashlib.sha256(instance_id.encode()).digest()[:8], "big") / 2**64
    return ready_at + config.max_age_s * (1.0 - config.jitter * u)


def begin(
    routing: Sequence[Aged], last_ready: int | None, state: RecycleState, now: float, config: RecycleConfig
) -> tuple[RecycleState, str | None]:
    """Step 1, before the decision: the recycle under way, or a new one; and an outcome to count
    (`lost`, when the old instance left routing by other means). `last_ready` is the previous
    decision's READY count (None: no decision yet)."""
    current = state.current
    if current is not None:
        if any(a.id == current.old for a in routing):
            return state, None
        return replace(state, current=None), "lost"
    if now < state.not_before or last_ready is None or last_ready < len(routing):
        return state, None
    due = [(due_at(a.id, a.ready_at, config), a.id) for a in routing]
    overdue = [(at, ident) for at, ident in due if at <= now]
    if not overdue:
        return state, None
    _, old = min(overdue)
    return replace(state, current=Recycle(old, now, len(routing))), None


def settle(
    state: RecycleState, others_ready: int, wanted: int, granted: int, now: float, config: RecycleConfig
) -> Settled:
    """Step 3, after the decision. `others_ready`: READY instances in routing besides the old one;
    `wanted`: the policy's READY count, which does not count the old one; `granted`: what the
    fleet grants of it (`wanted` without a fleet)."""
    current = state.current
    if current is None:
        return Settled(state, None, None)
    if wanted < current.before:  # counted only if it got as far as asking for a replacement
        return Settled(
            RecycleState(None, now + config.retry_s), None, "called_off" if now > current.since else None
        )
    if others_ready >= max(current.before, min(wanted, granted)):
        return Settled(replace(state, current=None), current.old, "replaced")
    if granted < wanted and not current.waited:
        return Settled(replace(state, current=replace(current, waited=True)), None, "no_room")
    return Settled(state, None, None)
