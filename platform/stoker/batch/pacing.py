"""How many of a batch's lines may be sent now: a pure function of what the deployment's activator
sees, the batch's own requests in flight, and how far the batch is from its deadline.

A batch fills what interactive traffic leaves, and no more than its share:

    cap   = max(1, floor(slots × share))             slots: READY instances × their concurrency
    allow = min(concurrency − mine, cap − busy)      busy: every request in flight there, batch ones
                                                     (every batch's, not only this one's) too
    allow = 0 while an interactive request is held   (it goes first)

With 8 slots, share 0.5 and 1 interactive request in flight, a batch with nothing in flight may send
3 (cap 4 − busy 1); with 4 interactive in flight it sends none, and the 4 free slots stay for the
next interactive arrivals. At zero (no slot awake) a batch sends one line, whose hold brings an
instance up (the activator pokes the pool), and waits for it.

A batch that would miss its window at the rate it has managed is `urgent`: it may then send up to
its own concurrency whatever the room, and the requests held for it make the scaler add instances
(they are held at `BATCH_PRIORITY`, behind every interactive request). With no rate measured yet
it is urgent only in the last `URGENT_FRACTION` of its window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

URGENT_FRACTION = 0.25  # with no rate measured: urgent in the last quarter of the window


@dataclass(frozen=True)
class Room:
    """What one deployment's activators see now."""

    slots: int  # READY instances' concurrency, summed
    busy: int  # requests in flight on them
    held: int  # requests held, waiting for a slot
    batch: int = 0  # of those, every batch's lines sent there (counted by the runner, exactly)


def allowance(room: Room | None, mine: int, share: float, concurrency: int, urgent: bool) -> int:
    """Lines the batch may send now. `room` None: the deployment is not here (its lines are sent
    one at a time, and answered 404 by the endpoint)."""
    free = concurrency - mine
    if free <= 0:
        return 0
    if urgent:
        return free
    if room is None:
        return 1 if mine == 0 else 0
    if room.slots == 0:
        return 1 if room.batch == 0 else 0
    # The activator's counts include the batch lines; the runner's own count tells them apart. A
    # line just sent may not be in the activator's yet: then `interactive` is low for a moment,
    # never the batch's own count.
    interactive = max(0, room.busy - room.batch)
    if room.held > room.batch:
        return 0
    cap = max(1, math.floor(room.slots * share))
    return max(0, min(free, cap - interactive - room.batch))


def urgent(remaining: int, rate: float | None, time_left: float, window: float) -> bool:
    """Whether `remaining` lines at `rate` lines a second (None: not measured yet) would take more
    than half the `time_left` of a `window`-second window. E.g. 1,000 lines at 2/s need 500 s: urgent
    with 900 s left, not with 1,200 s."""
    if remaining <= 0:
        return False
    if time_left <= 0:
        return True
    if rate is None or rate <= 0:
        return time_left < URGENT_FRACTION * window
    return remaining / rate > 0.5 * time_left
