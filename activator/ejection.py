"""Outlier ejection: when an instance leaves the routing set for failing, and when it comes back.

Pure and table-tested, as `balancer.py`: each function takes an instance's `Health`, what happened
and `now`, and returns the next `Health`. The activator keeps one per instance and filters ejected
ones out before `balancer.pick`; its health loop does the probing (I/O) and calls `probed`.

    routable ──N consecutive failures──▶ ejected until now + base·2^(k-1) (≤ cap), k = times ejected
       ▲                                    │ the time is up: the next probe (GET /health)
       └──────────── probe answers 200 ◀────┤
                                            └ probe fails: ejected again, for twice as long

A failure is a request that failed before its first byte (refused, reset, no headers in time, a
502/503/504) or a failed active probe. A request answered in full clears the failure count and `k`,
so an instance that flaps (back after a probe, then fails again) is ejected for longer each time:
with base 10 s and cap 300 s, 10, 20, 40 … 300 s. A successful probe of a routable instance clears
nothing: an engine whose /health says 200 while its requests time out must still leave.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EjectionRules:
    after: int  # consecutive failures that eject an instance
    base_s: float  # the first ejection's length; each next one without a success between doubles it
    max_s: float  # ... up to this


@dataclass(frozen=True)
class Health:
    failures: int = 0  # consecutive failures since the last success
    ejections: int = 0  # consecutive ejections since the last success
    until: float | None = None  # ejected until then (monotonic seconds); None: routable

    @property
    def ejected(self) -> bool:
        return self.until is not None


HEALTHY = Health()


def ejection_s(rules: EjectionRules, ejections: int) -> float:
    """How long the `ejections`-th ejection in a row lasts."""
    return min(rules.max_s, rules.base_s * 2.0 ** min(ejections - 1, 64))


def succeeded(health: Health) -> Health:
    """A request was answered: the instance is fine."""
    return HEALTHY if not health.ejected else health  # an ejected one comes back only by a probe


def failed(health: Health, rules: EjectionRules, now: float) -> Health:
    """A request or a probe failed. The `after`-th failure in a row ejects the instance."""
    if health.ejected:
        return health
    failures = health.failures + 1
    if failures < rules.after:
        return Health(failures, health.ejections, None)
    ejections = health.ejections + 1
    return Health(0, ejections, now + ejection_s(rules, ejections))


def probe_due(health: Health, now: float) -> bool:
    """An ejected instance whose ejection is over is probed before it takes requests again."""
    return health.until is not None and now >= health.until


def probed(health: Health, ok: bool, rules: EjectionRules, now: float) -> Health:
    """The answer of a probe. Ejected: a 200 re-admits it (the next failure starts a new count, and
    the next ejection lasts twice as long unless a request succeeds first); a failure ejects it
    again, for twice as long. Routable: a failure counts as any failure; a 200 changes nothing."""
    if not health.ejected:
        return failed(health, rules, now) if not ok else health
    if not probe_due(health, now):  # a probe sent before it was ejected: its time is not up
        return health
    if ok:
        return Health(0, health.ejections, None)
    ejections = health.ejections + 1
    return Health(0, ejections, now + ejection_s(rules, ejections))
