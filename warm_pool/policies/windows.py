"""Small pure helpers over time windows, shared by the policies: a bounded running peak and a
per-second sample window, both as tuples so that policy states stay frozen and bounded."""

from __future__ import annotations

import math

from warm_pool.policies.base import SecondSample

Peak = tuple[tuple[float, int], ...]  # (time, value), times rising and values falling


def push_peak(history: Peak, now: float, value: int, window_s: float) -> Peak:
    """Add `value` seen at `now`; keep only what can still be the window's maximum.

    An entry at or below a newer one can never be the maximum again, so it is dropped on arrival:
    with values in 0..max the tuple never holds more than max + 1 entries."""
    kept = [(t, v) for t, v in history if now - t < window_s and v > value]
    return (*kept, (now, value))


def peak(history: Peak, now: float, window_s: float) -> int:
    """The highest value seen in the last `window_s` seconds (0 if none)."""
    return max((v for t, v in history if now - t < window_s), default=0)


def push_seconds(
    samples: tuple[SecondSample, ...], new: tuple[SecondSample, ...], now: float, window_s: float
) -> tuple[SecondSample, ...]:
    """The whole seconds that ended within the last `window_s` seconds before `now`, oldest first."""
    return tuple(s for s in (*samples, *new) if s.start + 1.0 > now - window_s)


def instances_for(concurrency: float, per_instance: float) -> int:
    """ceil(concurrency / per_instance), without float dust turning 3.0000000001 into 4."""
    if concurrency <= 0:
        return 0
    return max(1, math.ceil(concurrency / per_instance - 1e-9))
