"""The engine's generation slots (`stoker.engine.admission.Slots`): a freed slot goes to the waiter
with the lowest priority, the longest waiting among equals; a waiter that leaves gives up its place,
or hands on a slot it was given. Driven step by step on the event loop, no model, no clock."""

from __future__ import annotations

import asyncio

from stoker.engine.admission import Slots


async def settle() -> None:
    for _ in range(5):  # let every task that can run, run
        await asyncio.sleep(0)


async def test_freed_slots_go_lowest_priority_first_then_in_arrival_order() -> None:
    slots = Slots(1)
    await slots.acquire()
    assert slots.locked()
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await slots.acquire(priority)
        order.append(name)

    tasks = []
    for name, priority in (("bulk1", 10), ("bulk2", 10), ("default", 0), ("urgent", -5), ("bulk3", 10)):
        tasks.append(asyncio.ensure_future(wait(name, priority)))
        await settle()
    assert slots.waiting == 5 and order == []
    for _ in range(5):
        slots.release()
        await settle()
    assert order == ["urgent", "default", "bulk1", "bulk2", "bulk3"]
    slots.release()
    assert not slots.locked() and slots.waiting == 0
    await asyncio.gather(*tasks)


async def test_with_every_priority_0_it_is_arrival_order() -> None:
    slots = Slots(2)
    await slots.acquire()
    await slots.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        await slots.acquire()
        order.append(i)

    tasks = [asyncio.ensure_future(wait(i)) for i in range(4)]
    await settle()
    for _ in range(4):
        slots.release()
        await settle()
    assert order == [0, 1, 2, 3]
    await asyncio.gather(*tasks)


async def test_a_waiter_that_leaves_gives_up_its_place_or_hands_on_its_slot() -> None:
    slots = Slots(1)
    await slots.acquire()
    gone = asyncio.ensure_future(slots.acquire(-1))
    stays = asyncio.ensure_future(slots.acquire(3))
    await settle()
    gone.cancel()  # its deadline: it leaves the queue
    await settle()
    assert slots.waiting == 1
    slots.release()
    await settle()
    assert stays.done()  # the slot went to the one still waiting

    late = asyncio.ensure_future(slots.acquire())
    await settle()
    slots.release()  # handed to `late` ...
    late.cancel()  # ... which leaves before it runs: the slot is free again, not lost
    await settle()
    assert late.cancelled() and not slots.locked()
    await asyncio.wait_for(slots.acquire(), 1)
