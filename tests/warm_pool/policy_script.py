"""Driving a policy on a fake clock in tests: observations built from whole-second samples."""

from __future__ import annotations

from warm_pool.policies.base import Observation, SecondSample, TierTimes


def second(t: float, concurrency: float, arrivals: int = 0) -> SecondSample:
    return SecondSample(float(t), arrivals, float(concurrency))


def obs(
    *,
    ready: int = 0,
    in_flight: int = 0,
    queued: int = 0,
    starting: int = 0,
    sleeping: int = 0,
    waking: int = 0,
    last_arrival: float | None = None,
    seconds: tuple[SecondSample, ...] = (),
    idle_since: float | None = None,
    idle_gaps: tuple[float, ...] = (),
    latency_s: float | None = None,
    startup: TierTimes | None = None,
    start_tier: str = "disk",
    snapshot_id: str | None = None,
) -> Observation:
    return Observation(
        in_flight=in_flight,
        queued=queued,
        ready=ready,
        starting=starting,
        last_arrival=last_arrival,
        arrivals=sum(s.arrivals for s in seconds),
        seconds=seconds,
        idle_since=idle_since,
        idle_gaps=idle_gaps,
        sleeping=sleeping,
        waking=waking,
        latency_s=latency_s,
        startup=startup or TierTimes(),
        start_tier=start_tier,
        snapshot_id=snapshot_id,
    )


def every_second(policy, state, start: int, end: int, concurrency, **kw):
    """Call `policy` at each whole second in [start, end) with that second's sample just closed;
    `concurrency(t)` gives the load of second t - 1. Returns the decisions and the final state."""
    decisions = []
    for t in range(start, end):
        c = concurrency(t - 1)
        o = obs(seconds=(second(t - 1, c, arrivals=1 if c else 0),), in_flight=round(c), **kw)
        d, state = policy(o, state, float(t))
        decisions.append(d)
    return decisions, state
