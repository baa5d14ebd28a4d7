"""Load balancing: which ready instance takes the next request. Pure functions, table-tested.

`pick`: least outstanding requests, as Knative's activator does: an instance busy generating a long
answer keeps its slot, so counting what is in flight (not what was sent) follows real load.

`pick_by_prefix`: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
"Consistent Hashing with Bounded Loads", 2018), for prefix affinity (`affinity.py` makes the key).
Every instance sits at `POINTS` pseudo-random points on a ring of 64-bit numbers; a request walks
clockwise from its key's point to the first instance whose outstanding requests are below

    capacity = ceil(bound × (total outstanding + 1) / instances)

and below its own `max_concurrency`. Worked example: 2 instances holding 5 and 2 requests, bound
1.25: capacity = ceil(1.25 × 8 / 2) = 5, so the 8th request goes to the instance with 2 whichever
the ring names first. Some instance is always below the capacity (had both 5 or more, they would
hold 10 > 7), so the walk ends. An instance joining or leaving moves only the keys whose walk meets
its points (about 1/n of them): the others stay where their prefixes are cached.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from activator.source import Endpoint

# Points per instance on the ring. With 100, each of 2 to 8 instances owns its share of 4,000 keys
# within 12% (0.96-1.07 of a quarter for 4: tests/activator/test_affinity.py); more points spread
# keys more evenly and cost only memory and the ring's build, once per change of the routing set.
POINTS = 100


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


def point(text: str) -> int:
    """A stable 64-bit point on the ring: the same in every process and every run (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest())


@dataclass(frozen=True)
class Ring:
    """Each instance id at `POINTS` points: `points` sorted, `owners[i]` the id at `points[i]`."""

    ids: frozenset[str]
    points: tuple[int, ...]
    owners: tuple[str, ...]

    @classmethod
    def of(cls, ids: Iterable[str], points: int = POINTS) -> Ring:
        ids = frozenset(ids)
        placed = sorted((point(f"{id_}#{i}"), id_) for id_ in ids for i in range(points))
        return cls(ids, tuple(p for p, _ in placed), tuple(o for _, o in placed))

    def places(self, endpoints: Iterable[Endpoint]) -> bool:
        """Whether this ring holds exactly these endpoints' ids (else build another)."""
        return self.ids == frozenset(e.id for e in endpoints)


def capacity(total_outstanding: int, instances: int, bound: float) -> int:
    """The most requests one instance may hold once the next one is placed: ceil(bound × mean)."""
    return math.ceil(bound * (total_outstanding + 1) / instances)


def pick_by_prefix(
    endpoints: Sequence[Endpoint],
    outstanding: Mapping[str, int],
    key: int,
    bound: float,
    ring: Ring | None = None,
    start: int = 0,
) -> Endpoint | None:
    """The first endpoint clockwise from `key` on `ring` below the load `capacity` and below its
    `max_concurrency`. `ring` may place more ids than `endpoints` holds (those left out, e.g. the
    instance a retry excludes, are passed by); it is built from `endpoints` when None.

    When every endpoint below the capacity is full at its `max_concurrency` and another still has
    room, that one takes the request (`pick`, ties rotated from `start`): holding a request while an
    instance is free costs more than the imbalance. With equal `max_concurrency` it cannot happen.
    None when every endpoint is full, or there are none.
    """
    if not endpoints:
        return None
    by_id = {e.id: e for e in endpoints}
    if ring is None:
        ring = Ring.of(by_id)
    total = sum(outstanding.get(id_, 0) for id_ in by_id)
    limit = capacity(total, len(by_id), bound)
    points, owners = ring.points, ring.owners
    n = len(points)
    seen: set[str] = set()
    first = bisect.bisect_left(points, key)
    for k in range(n):
        id_ = owners[(first + k) % n]
        if id_ in seen:
            continue
        seen.add(id_)
        endpoint = by_id.get(id_)
        if endpoint is not None:
            load = outstanding.get(id_, 0)
            if load < limit and load < endpoint.max_concurrency:
                return endpoint
        if len(seen) == len(ring.ids):
            break
    return pick(endpoints, outstanding, start)
