"""Load balancing: which ready instance takes the next request. A pure function, table-tested.

Least outstanding requests, as Knative's activator does: an instance busy generating a long answer
keeps its slot, so counting what is in flight (not what was sent) follows real load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from activator.source import Endpoint


def pick(endpoints: Sequence[Endpoint], outstanding: Mapping[str, int], start: int) -> Endpoint | None:
    """The endpoint with the fewest outstanding requests among those below their `max_concurrency`.

    Ties go to the first one met when scanning from index `start` (modulo the length) and wrapping
    around; the caller passes a counter it increments, so equal instances take turns. None when every
    endpoint is full, or there are none.
    """
    n = len(endpoints)
    best: Endpoint | None = None
    best_load = 0
    for k in range(n):
        endpoint = endpoints[(start + k) % n]
        load = outstanding.get(endpoint.id, 0)
        if load >= endpoint.max_concurrency:
            continue
        if best is None or load < best_load:
            best, best_load = endpoint, load
    return best
