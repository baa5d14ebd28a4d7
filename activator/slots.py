"""Slots: requests outstanding on each instance, and the FIFO of requests held until one frees.

All of it is synchronous and runs on the event loop, so a grant (pick an endpoint, count it,
resolve the waiter's future) is atomic; no locks. The activator owns the waiting (deadlines,
keep-alives, disconnects); this module owns who gets the next free slot.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Collection, Sequence

from activator.balancer import pick
from activator.source import Endpoint

Key = tuple[str, str]  # (id, url): an instance restarted under the same id on a new port is new


def key(endpoint: Endpoint) -> Key:
    return (endpoint.id, endpoint.url)


class Waiter:
    """A held request. Its future resolves to the endpoint whose slot it was granted."""

    __slots__ = ("exclude", "future")

    def __init__(self, exclude: Collection[Key]) -> None:
        self.exclude = exclude
        self.future: asyncio.Future[Endpoint] = asyncio.get_running_loop().create_future()


class Slots:
    def __init__(self, endpoints: Callable[[], Sequence[Endpoint]]) -> None:
        self._endpoints = endpoints
        self.outstanding: dict[str, int] = {}  # endpoint id -> requests granted and not yet released
        self._waiters: deque[Waiter] = deque()
        self._turn = 0  # rotates ties in `pick`

    @property
    def held(self) -> int:
        return len(self._waiters)

    @property
    def in_flight(self) -> int:
        return sum(self.outstanding.values())

    def try_acquire(self, exclude: Collection[Key] = ()) -> Endpoint | None:
        """A slot now, or None. Held requests are served first: a newcomer only gets what is left
        after `dispatch`, which is nothing if a plain request is still held, and otherwise only
        capacity that the held retries may not use."""
        self.dispatch()
        endpoint = self._pick(self._endpoints(), exclude)
        if endpoint is not None:
            self._take(endpoint)
        return endpoint

    def hold(self, exclude: Collection[Key] = (), front: bool = False) -> Waiter:
        """Queue a request (at the front for a retry, which has waited already)."""
        waiter = Waiter(exclude)
        if front:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        return waiter

    def abandon(self, waiter: Waiter) -> None:
        """The held request gave up (deadline, disconnect, cancellation): leave the queue, and give
        back a slot granted in the same loop iteration but never used."""
        try:
            self._waiters.remove(waiter)
        except ValueError:
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
        while self._waiters:
            self._waiters.popleft().future.set_exception(error())

    def dispatch(self) -> None:
        """Grant free slots to held requests in arrival order. One that may not use what is free
        (it excludes the instance that just failed it) lets the next one past."""
        if not self._waiters:
            return
        endpoints = self._endpoints()
        for waiter in list(self._waiters):
            endpoint = self._pick(endpoints, waiter.exclude)
            if endpoint is None:
                if not waiter.exclude:
                    return  # nothing free for anyone
                continue
            self._waiters.remove(waiter)
            self._take(endpoint)
            waiter.future.set_result(endpoint)

    def _pick(self, endpoints: Sequence[Endpoint], exclude: Collection[Key]) -> Endpoint | None:
        if exclude:
            endpoints = [e for e in endpoints if key(e) not in exclude]
        self._turn += 1
        return pick(endpoints, self.outstanding, self._turn)

    def _take(self, endpoint: Endpoint) -> None:
        self.outstanding[endpoint.id] = self.outstanding.get(endpoint.id, 0) + 1
