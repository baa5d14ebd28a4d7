"""How long to wait before restarting a deployment's instance that failed: exponential, capped.

restarts so far → delay: 0 → 1 s, 1 → 2 s, 2 → 4 s, … 5 → 32 s, 6 and on → 60 s. Deterministic
(no jitter): instances of one deployment fail and restart one at a time, so there is no herd to
spread, and the simulator replays the same delays. tenacity does the arithmetic; the pool owns
the clock and the waiting.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tenacity import wait_exponential


def restart_delay(restarts: int, *, initial_s: float = 1.0, cap_s: float = 60.0) -> float:
    if restarts < 0:
        raise ValueError(f"restarts must be >= 0, got {restarts}")
    wait = wait_exponential(multiplier=initial_s, max=cap_s)
    # tenacity's waits read only `attempt_number` (1 for the first retry) from the retry state.
    state: Any = SimpleNamespace(attempt_number=restarts + 1)
    return float(wait(state))
