"""Slots: requests outstanding on each instance, and the fair queue of requests held until one frees.

All of it is synchronous and runs on the event loop, so a grant (pick an endpoint, count it,
resolve the waiter's future) is atomic; no locks. The activator owns the waiting (deadlines,
keep-alives, disconnects); this module owns who gets the next free slot.

Held requests belong to an owner (the API key that sent them) and are served by start-time fair
queueing: each gets a tag one past the later of its owner's last tag and the tag last granted, and
the smallest tag goes first. One owner alone is served in arrival order; several take turns, one
request each, however many each has queued. Retries go before everything (they have waited once
already). When the queue is full, `displace` refuses the newest request of the owner holding the
most, so that a newcomer from an owner holding fewer still gets its place: no key can fill the
queue for the others.

Each request may carry a prefix key (`affinity.request_key`; None in least-outstanding mode, or when
its body has no prompt to read): with one, its instance is picked by consistent hashing with
bounded loads (`balancer.pick_by_prefix`) on a ring of the routable instances, kept until that set
changes; without, by least outstanding (`balancer.pick`).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable, Collection, Sequence

from activator.affinity import Balance
from activator.balancer import Ring, pick, pick_by_prefix
from activator.source import Endpoint

Key = tuple[str, str]  # (id, url): an instance restarted under the same id on a new port is new


def key(endpoint: Endpoint) -> Key:
    return (endpoint.id, endpoint.url)


class Waiter:
    """A held request. Its future resolves to the endpoint whose slot it was granted."""

    __slots__ = ("exclude", "future", "order", "owner", "prefix", "tag")

    def __init__(
        self,
        exclude: Collection[Key],
        owner: str,
        tag: int,
        order: tuple[int, int, int],
        prefix: int | None = None,
    ) -> None:
        self.exclude = exclude
        self.prefix = prefix  # its prefix key, or None
        self.owner = owner
        self.tag = tag
        self.order = order  # its place in the queue: (0 for a retry, else 1; tag; sequence)
        self.future: asyncio.Future[Endpoint] = asyncio.get_running_loop().create_future()

    def __lt__(self, other: Waiter) -> bool:
        return self.order < other.order


class Slots:
    def __init__(self, endpoints: Callable[[], Sequence[Endpoint]], bound: float = Balance.bound) -> None:
        self._endpoints = endpoints
        self.bound = bound  # prefix affinity's load factor (`pick_by_prefix`)
        self._ring: Ring | None = None  # the routable instances on the ring, for keyed requests
        self.outstanding: dict[str, int] = {}  # endpoint id -> requests granted and not yet released
        self._waiters: list[Waiter] = []  # sorted by `Waiter.order`
        self._turn = 0  # rotates ties in `pick`
        self._granted_tag = 0  # the largest tag granted so far (the queue's virtual time)
        self._last_tag: dict[str, int] = {}  # owner -> its newest waiter's tag, while it has any
        self._held_by: dict[str, int] = {}  # owner -> its waiters (retries not counted)
        self._seq = itertools.count()

    @property
    def held(self) -> int:
        return len(self._waiters)

    @property
    def in_flight(self) -> int:
        return sum(self.outstanding.values())

    def try_acquire(self, exclude: Collection[Key] = (), prefix: int | None = None) -> Endpoint | None:
        """A slot now, or None. Held requests are served first: a newcomer only gets what is left
        after `dispatch`, which is nothing if a plain request is still held, and otherwise only
        capacity that the held retries may not use. `prefix`: the request's prefix key, if any."""
        self.dispatch()
        endpoint = self._pick(self._endpoints(), exclude, prefix)
        if endpoint is not None:
            self._take(endpoint)
        return endpoint

    def held_by(self, owner: str) -> int:
        return self._held_by.get(owner, 0)

    def hold(
        self, exclude: Collection[Key] = (), front: bool = False, owner: str = "", prefix: int | None = None
    ) -> Waiter:
        """Queue a request of `owner` (with its prefix key, if any): at its fair place, or at the
        front for a retry (the newest retry first: it has waited once already)."""
        seq = next(self._seq)
        if front:
            waiter = Waiter(exclude, owner, 0, (0, 0, -seq), prefix)
        else:
            tag = max(self._granted_tag, self._last_tag.get(owner, 0)) + 1
            self._last_tag[owner] = tag
            self._held_by[owner] = self._held_by.get(owner, 0) + 1
            waiter = Waiter(exclude, owner, tag, (1, tag, seq), prefix)
        bisect.insort(self._waiters, waiter)
        return waiter

    def displace(self, owner: str, error: Callable[[], BaseException]) -> bool:
        """Make room for one more request of `owner` in a full queue: the owner holding the most,
        if it holds at least two more than `owner` does, loses its newest held request (its
        future raises `error()`). False when the queue is already shared fairly."""
        if not self._held_by:
            return False
        most = max(self._held_by, key=self._held_by.__getitem__)
        if self._held_by[most] < self.held_by(owner) + 2:
            return False
        victim = max((w for w in self._waiters if w.owner == most and w.order[0]), key=lambda w: w.order)
        self._remove(victim)
        victim.future.set_exception(error())
        return True

    def abandon(self, waiter: Waiter) -> None:
        """The held request gave up (deadline, disconnect, cancellation): leave the queue, and give
        back a slot granted in the same loop iteration but never used."""
        if not self._remove(waiter):
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result().id)
            return
        waiter.future.cancel()

    def release(self, endpoint_id: str) -> None:
        """A request on `endpoint_id` finished: its slot goes to the longest-held request."""
        left = self.outstanding.get(endpoint_id, 0) - 1
        if left > 0:
            self.outstanding[endpoint_id] = left
        else:
            self.outstanding.pop(endpoint_id, None)
        self.dispatch()

    def fail_held(self, error: Callable[[], BaseException]) -> None:
        """Every held request stops waiting: its future raises a fresh `error()`."""
        waiters, self._waiters = self._waiters, []
        self._held_by.clear()
        self._last_tag.clear()
        for waiter in waiters:
            waiter.future.set_exception(error())

    def dispatch(self) -> None:
        """Grant free slots to held requests in queue order. One that may not use what is free
        (it excludes the instance that just failed it) lets the next one past."""
        if not self._waiters:
            return
        endpoints = self._endpoints()
        for waiter in list(self._waiters):
            endpoint = self._pick(endpoints, waiter.exclude, waiter.prefix)
            if endpoint is None:
                if not waiter.exclude:
                    return  # nothing free for anyone
                continue
            self._remove(waiter)
            self._granted_tag = max(self._granted_tag, waiter.tag)
            self._take(endpoint)
            waiter.future.set_result(endpoint)

    def _remove(self, waiter: Waiter) -> bool:
        """Take `waiter` out of the queue; False if it was not in it."""
        i = bisect.bisect_left(self._waiters, waiter)
        if i == len(self._waiters) or self._waiters[i] is not waiter:
            return False
        del self._waiters[i]
        if waiter.order[0]:
            owner = waiter.owner
            left = self._held_by[owner] - 1
            if left:
                self._held_by[owner] = left
            else:  # none left queued: its next request starts from the virtual time
                del self._held_by[owner]
                self._last_tag.pop(owner, None)
        return True

    def _pick(
        self, endpoints: Sequence[Endpoint], exclude: Collection[Key], prefix: int | None
    ) -> Endpoint | None:
        self._turn += 1
        if prefix is not None:
            ring = self._ring
            if ring is None or not ring.places(endpoints):
                ring = self._ring = Ring.of(e.id for e in endpoints)
            if exclude:
                endpoints = [e for e in endpoints if key(e) not in exclude]
            return pick_by_prefix(endpoints, self.outstanding, prefix, self.bound, ring, self._turn)
        if exclude:
            endpoints = [e for e in endpoints if key(e) not in exclude]
        return pick(endpoints, self.outstanding, self._turn)

    def _take(self, endpoint: Endpoint) -> None:
        self.outstanding[endpoint.id] = self.outstanding.get(endpoint.id, 0) + 1
