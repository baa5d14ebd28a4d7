"""Slots: requests outstanding on each instance, and the fair queue of requests held until one frees.

All of it is synchronous and runs on the event loop, so a grant (pick an endpoint, count it,
resolve the waiter's future) is atomic; no locks. The activator owns the waiting (deadlines,
keep-alives, disconnects); this module owns who gets the next free slot.

Held requests belong to an owner (the API key that sent them) and a priority class (an integer,
vLLM's semantics: lower is served first; `stoker.spec.priority`). The queue's order is

    (retry first, priority class, fair tag, arrival)

so a class is served only when every class below it is empty, and within one class owners share by
start-time fair queueing: each request gets a tag one past the later of its owner's last tag in
that class and the tag last granted in that class, and the smallest tag goes first. One owner alone
is served in arrival order; several take turns, one request each, however many each has queued.
Each class keeps its own tags (`_Class`), so a key's bulk requests do not push back its own
interactive ones, and a class's state goes when its last request leaves (at most one per request
held). Retries go before everything (they have waited once already).

When the queue is full, `displace` makes room for a newcomer: first at the expense of the class
served last, if that is served after the newcomer's (its biggest holder's newest request is
refused); otherwise within the newcomer's own class, the newest request of the owner holding the
most there, if it holds at least two more than the newcomer's owner: no key can fill the queue for
the others of its class, and no lower class can keep out a higher one.

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

    __slots__ = ("exclude", "future", "order", "owner", "prefix", "priority", "tag")

    def __init__(
        self,
        exclude: Collection[Key],
        owner: str,
        tag: int,
        order: tuple[int, int, int, int],
        prefix: int | None = None,
        priority: int = 0,
    ) -> None:
        self.exclude = exclude
        self.prefix = prefix  # its prefix key, or None
        self.owner = owner
        self.priority = priority  # its class: lower is served first
        self.tag = tag
        # its place in the queue: (0 for a retry, else 1; priority; tag; sequence)
        self.order = order
        self.future: asyncio.Future[Endpoint] = asyncio.get_running_loop().create_future()

    def __lt__(self, other: Waiter) -> bool:
        return self.order < other.order


class _Class:
    """One priority class's fair queueing: its virtual time (the largest tag granted in it) and,
    for each owner with requests held in it, its newest tag and how many it holds (retries not
    counted)."""

    __slots__ = ("granted", "held", "last")

    def __init__(self) -> None:
        self.granted = 0
        self.last: dict[str, int] = {}
        self.held: dict[str, int] = {}


class Slots:
    def __init__(self, endpoints: Callable[[], Sequence[Endpoint]], bound: float = Balance.bound) -> None:
        self._endpoints = endpoints
        self.bound = bound  # prefix affinity's load factor (`pick_by_prefix`)
        self._ring: Ring | None = None  # the routable instances on the ring, for keyed requests
        self.outstanding: dict[str, int] = {}  # endpoint id -> requests granted and not yet released
        self._waiters: list[Waiter] = []  # sorted by `Waiter.order`
        self._turn = 0  # rotates ties in `pick`
        self._classes: dict[int, _Class] = {}  # priority -> its fair queueing, while it holds any
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

    def held_by(self, owner: str, priority: int | None = None) -> int:
        """Requests `owner` holds (retries not counted): in class `priority`, or in all (None)."""
        if priority is not None:
            cls = self._classes.get(priority)
            return 0 if cls is None else cls.held.get(owner, 0)
        return sum(cls.held.get(owner, 0) for cls in self._classes.values())

    def hold(
        self,
        exclude: Collection[Key] = (),
        front: bool = False,
        owner: str = "",
        prefix: int | None = None,
        priority: int = 0,
    ) -> Waiter:
        """Queue a request of `owner` (with its prefix key, if any) in class `priority`: at its fair
        place in that class, or at the front for a retry (the newest retry of the class served
        first goes first: it has waited once already)."""
        seq = next(self._seq)
        if front:
            waiter = Waiter(exclude, owner, 0, (0, priority, 0, -seq), prefix, priority)
        else:
            cls = self._classes.get(priority)
            if cls is None:
                cls = self._classes[priority] = _Class()
            tag = max(cls.granted, cls.last.get(owner, 0)) + 1
            cls.last[owner] = tag
            cls.held[owner] = cls.held.get(owner, 0) + 1
            waiter = Waiter(exclude, owner, tag, (1, priority, tag, seq), prefix, priority)
        bisect.insort(self._waiters, waiter)
        return waiter

    def displace(self, owner: str, error: Callable[[], BaseException], priority: int = 0) -> bool:
        """Make room for one more request of `owner` in class `priority` in a full queue (see the
        module): the chosen request leaves, its future raising `error()`. False when nothing held
        is served after it and its own class is already shared fairly."""
        if not self._classes:
            return False
        last = max(self._classes)
        if last > priority:  # a class served after the newcomer's gives up its place
            cls = self._classes[last]
            most = max(cls.held, key=cls.held.__getitem__)
        else:
            cls = self._classes.get(priority)
            if cls is None:
                return False
            most = max(cls.held, key=cls.held.__getitem__)
            if cls.held[most] < cls.held.get(owner, 0) + 2:
                return False
            last = priority
        victim = max(
            (w for w in self._waiters if w.order[0] and w.owner == most and w.priority == last),
            key=lambda w: w.order,
        )
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
        self._classes.clear()
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
            if (cls := self._classes.get(waiter.priority)) is not None and waiter.order[0]:
                cls.granted = max(cls.granted, waiter.tag)  # gone with its last request: starts again
            self._take(endpoint)
            waiter.future.set_result(endpoint)

    def _remove(self, waiter: Waiter) -> bool:
        """Take `waiter` out of the queue; False if it was not in it."""
        i = bisect.bisect_left(self._waiters, waiter)
        if i == len(self._waiters) or self._waiters[i] is not waiter:
            return False
        del self._waiters[i]
        if waiter.order[0]:
            owner, cls = waiter.owner, self._classes[waiter.priority]
            left = cls.held[owner] - 1
            if left:
                cls.held[owner] = left
            else:  # none left queued: its next request starts from the class's virtual time
                del cls.held[owner]
                del cls.last[owner]
                if not cls.held:  # the class is empty: its tags start again from 0
                    del self._classes[waiter.priority]
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
