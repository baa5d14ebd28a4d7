"""`Slots`: outstanding counts and the FIFO of held requests, driven step by step in memory."""

from __future__ import annotations

from activator.slots import Slots, key
from tests.activator.conftest import Ep, MemorySource


def granted(waiter) -> str | None:
    return waiter.future.result().id if waiter.future.done() and not waiter.future.cancelled() else None


async def test_counts_and_limits() -> None:
    source = MemorySource([Ep("a", "u1", 1), Ep("b", "u2", 2)])
    slots = Slots(source.endpoints)
    got = [slots.try_acquire().id for _ in range(3)]
    assert sorted(got) == ["a", "b", "b"]
    assert slots.try_acquire() is None
    assert slots.outstanding == {"a": 1, "b": 2} and slots.in_flight == 3
    slots.release("a")
    assert slots.outstanding == {"b": 2}  # zero counts are dropped
    assert slots.try_acquire().id == "a"


async def test_held_requests_are_served_in_arrival_order() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    first, second, third = slots.hold(), slots.hold(), slots.hold()
    assert slots.held == 3
    source.eps.append(Ep("a", "u1", 1))
    slots.dispatch()  # what capacity_changed does
    assert [granted(w) for w in (first, second, third)] == ["a", None, None]
    slots.release("a")  # a request finishes: its slot goes to the next held one
    assert [granted(w) for w in (second, third)] == ["a", None]
    assert slots.held == 1


async def test_newcomer_does_not_jump_the_queue() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    held = slots.hold()
    source.eps.append(Ep("a", "u1", 1))  # capacity appears, nobody has said so yet
    assert slots.try_acquire() is None  # the newcomer dispatches first: the held one gets it
    assert granted(held) == "a"


async def test_retry_skips_the_instance_that_failed_it_and_does_not_block_others() -> None:
    a = Ep("a", "u1", 1)
    source = MemorySource([a])
    slots = Slots(source.endpoints)
    assert slots.try_acquire().id == "a"
    retry = slots.hold(exclude=(key(a),), front=True)
    plain = slots.hold()
    slots.release("a")
    assert granted(retry) is None and granted(plain) == "a"
    source.eps.append(Ep("b", "u2", 1))
    slots.dispatch()
    assert granted(retry) == "b"


async def test_same_id_on_a_new_url_is_a_new_instance() -> None:
    source = MemorySource([Ep("a", "u1", 1)])
    slots = Slots(source.endpoints)
    assert slots.try_acquire(exclude=(("a", "u1"),)) is None
    source.eps[:] = [Ep("a", "u9", 1)]
    assert slots.try_acquire(exclude=(("a", "u1"),)).url == "u9"


async def test_abandon_leaves_the_queue_and_returns_an_unused_grant() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    gone, waiting = slots.hold(), slots.hold()
    slots.abandon(gone)
    assert slots.held == 1 and gone.future.cancelled()
    late = slots.hold()
    source.eps.append(Ep("a", "u1", 1))
    slots.dispatch()
    assert granted(waiting) == "a"
    slots.abandon(waiting)  # granted in the same loop turn as its deadline: the slot goes on
    assert granted(late) == "a" and slots.outstanding == {"a": 1}
