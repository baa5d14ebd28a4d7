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


async def test_owners_take_turns_whatever_each_has_queued() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    flood = [slots.hold(owner="a") for _ in range(5)]
    late = [slots.hold(owner="b"), slots.hold(owner="b")]
    source.eps.append(Ep("x", "u1", 1))
    order = []
    for _ in range(7):
        slots.dispatch()
        (w,) = [w for w in flood + late if granted(w) and w not in order]
        order.append(w)
        slots.release("x")
    # b's two requests are served second and fourth, not after a's five.
    assert order == [flood[0], late[0], flood[1], late[1], flood[2], flood[3], flood[4]]
    assert slots.held == 0 and slots.held_by("a") == 0


async def test_one_owner_alone_is_served_in_arrival_order_and_retries_first() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    first, second = slots.hold(owner="a"), slots.hold(owner="a")
    retry = slots.hold(front=True, owner="b")
    source.eps.append(Ep("x", "u1", 1))
    slots.dispatch()
    assert granted(retry) == "x" and not first.future.done()
    slots.release("x")
    assert granted(first) == "x" and not second.future.done()
    assert slots.held_by("b") == 0  # a retry does not count against its owner's share


async def test_an_owner_that_left_the_queue_rejoins_at_the_current_turn() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    gone = [slots.hold(owner="b") for _ in range(3)]
    for w in gone:
        slots.abandon(w)  # b's requests timed out: its old place must not count against it
    a = [slots.hold(owner="a") for _ in range(3)]
    b = slots.hold(owner="b")
    source.eps.append(Ep("x", "u1", 1))
    slots.dispatch()
    slots.release("x")
    assert granted(a[0]) == "x" and granted(b) == "x"


async def test_a_full_queue_displaces_the_newest_request_of_the_biggest_holder() -> None:
    slots = Slots(MemorySource().endpoints)
    flood = [slots.hold(owner="a") for _ in range(4)]
    mine = slots.hold(owner="b")
    assert slots.displace("b", lambda: RuntimeError("full"))  # a holds 4, b would hold 2
    assert isinstance(flood[-1].future.exception(), RuntimeError)
    assert slots.held == 4 and slots.held_by("a") == 3
    slots.hold(owner="b")
    # a holds 3 and b would hold 3: shared fairly, so the newcomer is the one refused.
    assert not slots.displace("b", lambda: RuntimeError("full"))
    assert not slots.displace("a", lambda: RuntimeError("full"))
    assert not mine.future.done()


def drain(slots: Slots, waiters: list, endpoint: str = "x") -> list:
    """Serve every held request through one slot of `endpoint`: the order they were granted in."""
    order = []
    for _ in waiters:
        slots.dispatch()
        (w,) = [w for w in waiters if granted(w) and w not in order]
        order.append(w)
        slots.release(endpoint)
    return order


async def test_a_lower_priority_number_is_served_first_and_arrival_order_within_a_class() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    bulk = [slots.hold(owner="batch", priority=10) for _ in range(3)]
    default = slots.hold(owner="app")
    urgent = [slots.hold(owner="app", priority=-5), slots.hold(owner="app", priority=-5)]
    source.eps.append(Ep("x", "u1", 1))
    assert drain(slots, [*bulk, default, *urgent]) == [*urgent, default, *bulk]
    assert slots.held == 0


async def test_owners_take_turns_within_a_class_and_a_class_keeps_its_own_turns() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    # a's bulk requests take no turns from a's interactive ones: each class has its own tags.
    a_bulk = [slots.hold(owner="a", priority=5) for _ in range(3)]
    a = [slots.hold(owner="a") for _ in range(3)]
    b = [slots.hold(owner="b"), slots.hold(owner="b")]
    b_bulk = slots.hold(owner="b", priority=5)
    source.eps.append(Ep("x", "u1", 1))
    order = drain(slots, [*a_bulk, *a, *b, b_bulk])
    assert order == [a[0], b[0], a[1], b[1], a[2], a_bulk[0], b_bulk, a_bulk[1], a_bulk[2]]
    assert slots.held_by("a") == 0 and slots.held_by("b", 5) == 0


async def test_retries_go_first_whatever_their_class() -> None:
    source = MemorySource()
    slots = Slots(source.endpoints)
    urgent = slots.hold(owner="a", priority=-100)
    retry = slots.hold(front=True, owner="b", priority=100)
    source.eps.append(Ep("x", "u1", 1))
    assert drain(slots, [urgent, retry]) == [retry, urgent]


async def test_a_full_queue_displaces_the_class_served_last_first() -> None:
    slots = Slots(MemorySource().endpoints)
    full = lambda: RuntimeError("full")  # noqa: E731
    bulk = [slots.hold(owner="batch", priority=10) for _ in range(2)]
    other = slots.hold(owner="other", priority=5)
    # an interactive newcomer: the newest request of the class served last leaves, whoever holds it
    assert slots.displace("app", full, priority=0)
    assert isinstance(bulk[1].future.exception(), RuntimeError) and not bulk[0].future.done()
    assert slots.displace("app", full, priority=0)
    assert isinstance(bulk[0].future.exception(), RuntimeError)
    assert slots.displace("app", full, priority=0)  # then the next class up
    assert isinstance(other.future.exception(), RuntimeError)
    assert slots.held == 0 and not slots.displace("app", full, priority=0)


async def test_a_newcomer_of_the_class_served_last_displaces_only_within_its_class() -> None:
    slots = Slots(MemorySource().endpoints)
    full = lambda: RuntimeError("full")  # noqa: E731
    app = [slots.hold(owner="app") for _ in range(4)]
    # a bulk newcomer may not take an interactive request's place, however many app holds
    assert not slots.displace("batch", full, priority=10)
    bulk = [slots.hold(owner="a", priority=10) for _ in range(3)]
    assert slots.displace("b", full, priority=10)  # a holds 3 there, b would hold 1
    assert isinstance(bulk[2].future.exception(), RuntimeError)
    assert not any(w.future.done() for w in app)
    assert slots.held_by("a", 10) == 2 and slots.held_by("app") == 4
