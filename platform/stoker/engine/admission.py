"""The engine's generation slots: a semaphore whose waiters are served by priority.

`max_num_seqs` requests generate at once; the rest wait here (bounded and timed by the engine:
`Engine._admit`). A freed slot goes to the waiter with the lowest `priority` (vLLM's semantics,
`stoker.spec.priority`), the longest waiting among equals, so with every priority 0 (the default)
this is `asyncio.Semaphore`'s arrival order. Like vLLM's priority scheduling, but without its
preemption: a running request keeps its slot.

A slot freed while waiters exist is handed to the chosen one directly, never left free for a
newcomer to take, so `free > 0` only while nobody waits. A waiter that leaves (its deadline, its
client gone) after it was handed a slot, but before it ran, hands that slot on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class Slots:
    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap: (priority, seq, future)
        self._seq = itertools.count()

    def locked(self) -> bool:
        """No slot for a newcomer now: it would wait."""
        return self._free == 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, priority: int = 0) -> None:
        if self._free > 0:
            self._free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._seq), future)
        heapq.heappush(self._waiters, entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # handed a slot as it left: the next waiter's
            elif entry in self._waiters:  # (a release may have passed it over already)
                self._waiters.remove(entry)  # at most the engine's `max_waiting`
                heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
                return
        self._free += 1
