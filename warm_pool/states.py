"""The instance lifecycle: states, the edges between them, and one instance's record.

```
PENDING ─▶ STARTING ─▶ READY ◀──▶ SLEEPING
   │          │          │           │
   │          │          ▼           │
   │          │      DRAINING ◀──────┘
   │          │          │
   └──────────┴──────────┴─▶ STOPPED      (PENDING/STARTING: cancelled; READY/SLEEPING only via DRAINING)
 any of PENDING..DRAINING ─▶ FAILED ─▶ STOPPED
```

A failed instance is not restarted in place: the pool stops it and starts a fresh `Instance`
(new id, new port) carrying `restarts + 1`, so every id names exactly one process.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from warm_pool.errors import InvalidTransition


class InstanceState(StrEnum):
    PENDING = "PENDING"  # snapshot being made local; no process yet
    STARTING = "STARTING"  # process up, loading the model
    READY = "READY"  # takes requests
    SLEEPING = "SLEEPING"  # weights in host RAM, accelerator freed
    DRAINING = "DRAINING"  # no new requests; in-flight ones finish within the grace period
    STOPPED = "STOPPED"  # process gone; terminal
    FAILED = "FAILED"  # process died or never became ready; stopped next


S = InstanceState
TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    S.PENDING: frozenset({S.STARTING, S.FAILED, S.STOPPED}),
    S.STARTING: frozenset({S.READY, S.FAILED, S.STOPPED}),
    S.READY: frozenset({S.SLEEPING, S.DRAINING, S.FAILED}),
    S.SLEEPING: frozenset({S.READY, S.DRAINING, S.FAILED}),
    S.DRAINING: frozenset({S.STOPPED, S.FAILED}),
    S.FAILED: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}
TERMINAL = frozenset({S.STOPPED})
COMING_UP = frozenset({S.PENDING, S.STARTING})


def transition(current: InstanceState, new: InstanceState, instance_id: str | None = None) -> InstanceState:
    """`new` if the lifecycle has an edge from `current` to it; otherwise `InvalidTransition`."""
    if new not in TRANSITIONS[current]:
        raise InvalidTransition(current.value, new.value, instance_id)
    return new


def new_instance_id(deployment: str, token: str | None = None) -> str:
    """`<deployment>-<8 hex>`; `token` fixes the hex part (tests)."""
    return f"{deployment}-{token if token is not None else secrets.token_hex(4)}"


@dataclass
class Instance:
    """One engine instance of a deployment, as the pool tracks it; also the activator's `Endpoint`.

    Times are the pool's monotonic clock. `accounted_at` is how far instance-seconds have been
    reported: `accrue(now)` and `move_to(...)` hand back the seconds since then, in the state they
    were spent in, for `stoker_instance_seconds_total`.
    """

    id: str
    deployment: str
    created_at: float
    max_concurrency: int
    state: InstanceState = InstanceState.PENDING
    host: str = "127.0.0.1"
    port: int | None = None
    address: str | None = None  # the engine's base URL as its backend reported it (a pod's IP)
    device: str | None = None  # the shared device it reserves memory on (`warm_pool.fleet`), if any
    restarts: int = 0
    log_path: Path | None = None
    secret: str = field(default="", repr=False)  # the key the engine wants from its callers; "" if none
    state_since: float = field(default=-1.0)
    accounted_at: float = field(default=-1.0)
    # Edges taken so far: two looks with the same count saw no move between them, even on a clock
    # that did not advance (the pool's sleep-state checks rely on it: `warm_pool.reconcile`).
    transitions: int = 0

    def __post_init__(self) -> None:
        if self.state_since < 0:
            self.state_since = self.created_at
        if self.accounted_at < 0:
            self.accounted_at = self.created_at

    @property
    def url(self) -> str:
        if self.address is not None:
            return self.address
        if self.port is None:
            raise ValueError(f"instance {self.id} has no port yet (state {self.state.value})")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        """What every call to the engine carries: its key, as `Authorization: Bearer`."""
        return {"authorization": f"Bearer {self.secret}"} if self.secret else {}

    def accrue(self, now: float) -> tuple[InstanceState, float]:
        """Close out the seconds spent in the current state since last accounted (never negative)."""
        seconds = max(0.0, now - self.accounted_at)
        self.accounted_at = max(self.accounted_at, now)
        return self.state, seconds

    def move_to(self, new: InstanceState, now: float) -> tuple[InstanceState, float]:
        """Take the edge to `new` at `now`; returns (the state left, its unaccounted seconds)."""
        transition(self.state, new, self.id)
        left = self.accrue(now)
        self.state, self.state_since = new, now
        self.transitions += 1
        return left
