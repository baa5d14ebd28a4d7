"""The fleet arbiter's table (`warm_pool.arbiter`): who may be awake where, when not all fit."""

from __future__ import annotations

import pytest

from warm_pool.arbiter import Device, Grant, Wish, arbitrate, fits_now
from warm_pool.census import Member

GB = 1 << 30
ONE = [Device("cpu0", 3 * GB)]  # room for one awake (2 GB) and a few asleep (0.1 GB)
TWO = [Device("gpu0", 3 * GB), Device("gpu1", 3 * GB)]


def wish(name: str, ready: int, sleeping: int = 0, *, rate: float = 0.0, held: int = 0) -> Wish:
    return Wish(name, ready, sleeping, 2 * GB, GB // 10, rate=rate, horizon_s=1.0, held=held)


def awake(ident: str, device: str = "cpu0", *, busy: bool = False) -> Member:
    return Member(ident, ident.split("-")[0], device, True, busy)


def asleep(ident: str, device: str = "cpu0") -> Member:
    return Member(ident, ident.split("-")[0], device, False)


CASES = {
    "a start that fits goes to the freest device": (
        [wish("a", 1)],
        [],
        TWO,
        {"a": Grant(1, 0, ("gpu0",))},
    ),
    "two starts spread over two devices": (
        [wish("a", 1), wish("b", 1, rate=1.0)],
        [],
        TWO,
        {"b": Grant(1, 0, ("gpu0",)), "a": Grant(1, 0, ("gpu1",))},
    ),
    "held requests wake a sleeper: the idle awake one is put to sleep for it": (
        [wish("a", 1, 1), wish("b", 1, held=1)],
        [awake("a-1"), asleep("b-1")],
        ONE,
        {"a": Grant(0, 1, (), denied=1), "b": Grant(1, 0)},
    ),
    "a busy instance is never evicted": (
        [wish("a", 1), wish("b", 1, held=1)],
        [awake("a-1", busy=True), asleep("b-1")],
        ONE,
        {"a": Grant(1, 0), "b": Grant(0, 1, (), denied=1)},
    ),
    "two idle deployments do not evict each other: equal worth keeps what is awake": (
        [wish("a", 1, 1), wish("b", 1, 1)],
        [awake("a-1"), asleep("b-1")],
        ONE,
        {"a": Grant(1, 0), "b": Grant(0, 1, (), denied=1)},
    ),
    "the more valuable forecast wins the device": (
        [wish("a", 1, 1, rate=0.01), wish("b", 1, 1, rate=2.0)],
        [awake("a-1"), asleep("b-1")],
        ONE,
        {"a": Grant(0, 1, (), denied=1), "b": Grant(1, 0)},
    ),
    "a fresh start evicts the least valuable of several": (
        [wish("a", 1, 1, rate=0.5), wish("b", 1, 1, rate=0.1), wish("c", 1, held=2)],
        [awake("a-1", "gpu0"), awake("b-1", "gpu1")],
        TWO,
        {"a": Grant(1, 0), "b": Grant(0, 1, (), denied=1), "c": Grant(1, 0, ("gpu1",))},
    ),
    "scale-down frees memory before growth": (
        [wish("a", 0, 1), wish("b", 1)],
        [awake("a-1")],
        ONE,
        {"a": Grant(0, 1), "b": Grant(1, 0, ("cpu0",))},
    ),
    "a wake must happen on the sleeper's own device": (
        [wish("a", 1, 1), wish("b", 1, held=1)],
        [awake("a-1", "gpu0"), asleep("b-1", "gpu0"), awake("c-1", "gpu1")],
        TWO,
        {"a": Grant(0, 1, (), denied=1), "b": Grant(1, 0)},
    ),
    "nothing evicted when even all candidates would not make room": (
        [wish("a", 1), wish("b", 2, held=3)],
        [awake("a-1", busy=True)],
        [Device("cpu0", 5 * GB)],
        {"a": Grant(1, 0), "b": Grant(1, 0, ("cpu0",), denied=1)},
    ),
    "sleepers stopped to make room when sleeping is not enough": (
        [wish("a", 0, 3), wish("b", 1, held=1)],
        [asleep("a-1"), asleep("a-2"), asleep("a-3")],
        [Device("cpu0", 2 * GB + GB // 10)],
        {"a": Grant(0, 1), "b": Grant(1, 0, ("cpu0",))},
    ),
    "a deployment without a wish keeps what it holds": (
        [wish("b", 1, held=1)],
        [Member("a-1", "a", "cpu0", True, holds=2 * GB)],
        ONE,
        {"b": Grant(0, 0, (), denied=1)},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_arbiter_table(case):
    wishes, members, devices, expected = CASES[case]
    assert arbitrate(wishes, members, devices) == expected


def test_what_is_granted_fits_every_device():
    wishes = [wish(f"d{i}", 1, 1, rate=i / 10) for i in range(6)]
    members = [asleep(f"d{i}-1", "gpu0" if i % 2 else "gpu1") for i in range(6)]
    grants = arbitrate(wishes, members, TWO)
    assert sum(g.ready for g in grants.values()) == 2  # one awake per 3 GB device
    assert {name for name, g in grants.items() if g.ready} == {"d5", "d4"}  # the two worth most


def test_held_deployments_are_served_first_come_first_served_not_by_name():
    # Room for one start; both have a request held. "z" was held first: it goes first, where the
    # name used to decide ("a" before "z") and an early name took every slot a wave freed.
    a = Wish("a", 1, 0, 2 * GB, GB // 10, held=1, held_since=20.0)
    z = Wish("z", 1, 0, 2 * GB, GB // 10, held=1, held_since=10.0)
    grants = arbitrate([a, z], [], ONE)
    assert grants["z"] == Grant(1, 0, ("cpu0",))
    assert grants["a"] == Grant(0, 0, (), denied=1)
    # Held as long: by name, so the order is total.
    grants = arbitrate([a, Wish("z", 1, 0, 2 * GB, GB // 10, held=1, held_since=20.0)], [], ONE)
    assert grants["a"].ready == 1 and grants["z"].denied == 1


def test_a_forecast_never_jumps_the_line_of_the_held():
    # held_since only orders the held; a deployment with nothing held is worth its forecast.
    early = Wish("a", 1, 0, 2 * GB, GB // 10, rate=5.0, held_since=0.0)
    held = Wish("b", 1, 0, 2 * GB, GB // 10, held=1, held_since=50.0)
    assert arbitrate([early, held], [], ONE)["b"] == Grant(1, 0, ("cpu0",))


def _gpu_wish(
    name: str, ready: int, sleeping: int = 0, *, rate: float = 0.0, held: int = 0, asleep: int = 768 << 20
):
    return Wish(name, ready, sleeping, 40 * GB, asleep, rate=rate, horizon_s=1.0, held=held)


def test_a_fresh_start_puts_an_instance_to_sleep_rather_than_stop_a_sleeper():
    # Two 80 GB devices, each with a busy 40 GB instance. On gpu0 a sleeper's 0.75 GB is in the way of
    # a second 40 GB instance: the start there stops it (its next request a fresh start). On gpu1 an idle
    # instance worth more can be put to sleep (its next request a wake; it keeps no residual here).
    # The start goes to gpu1: fewest stops first, before the least worth lost.
    wishes = [
        _gpu_wish("x", 1),
        _gpu_wish("y", 1),
        _gpu_wish("s", 0, 1, rate=0.01),
        _gpu_wish("c", 1, rate=1.0, asleep=0),
        _gpu_wish("n", 1, held=1),
    ]
    members = [
        awake("x-1", "gpu0", busy=True),
        asleep("s-1", "gpu0"),
        awake("y-1", "gpu1", busy=True),
        awake("c-1", "gpu1"),
    ]
    devices = [Device("gpu0", 80 * GB), Device("gpu1", 80 * GB)]
    grants = arbitrate(wishes, members, devices)
    assert grants["n"] == Grant(1, 0, ("gpu1",))
    assert grants["c"] == Grant(0, 1, (), denied=1)  # put to sleep, not stopped
    assert grants["s"] == Grant(0, 1)  # kept
    # With the idle instance busy, stopping the sleeper is the only way: then it is stopped.
    members[3] = awake("c-1", "gpu1", busy=True)
    grants = arbitrate(wishes, members, devices)
    assert grants["n"] == Grant(1, 0, ("gpu0",))
    assert grants["s"] == Grant(0, 0)


EXTRA = 2 * GB - GB // 10  # what a wake adds to a sleeper's residual
FITS_NOW = {
    "no growth: the grant as it is": (Grant(1, 1), [awake("a-1"), asleep("a-2")], {"cpu0": 0}, Grant(1, 1)),
    "a wake that fits": (Grant(2, 0), [awake("a-1"), asleep("a-2")], {"cpu0": EXTRA}, Grant(2, 0)),
    "room for one wake of two: the other is kept asleep": (
        Grant(3, 0),
        [awake("a-1"), asleep("a-2"), asleep("a-3")],
        {"cpu0": EXTRA},
        Grant(2, 1, denied=1),
    ),
    "sleepers in the order given: the first one's device is full, so the wake waits": (
        Grant(2, 0),
        [awake("a-1"), asleep("a-2", "gpu0"), asleep("a-3", "gpu1")],
        {"gpu0": 0, "gpu1": 3 * GB},
        Grant(1, 1, denied=1),
    ),
    "a start on the grant's device": (
        Grant(1, 0, ("gpu1",)),
        [],
        {"gpu0": 3 * GB, "gpu1": 3 * GB},
        Grant(1, 0, ("gpu1",)),
    ),
    "no device named: the first with room": (
        Grant(1, 0),
        [],
        {"gpu0": GB, "gpu1": 3 * GB},
        Grant(1, 0, ("gpu1",)),
    ),
    "a start that fits nowhere waits": (Grant(1, 0, ("gpu0",)), [], {"gpu0": GB}, Grant(0, 0, denied=1)),
}


@pytest.mark.parametrize("grant, mine, free, expected", FITS_NOW.values(), ids=FITS_NOW.keys())
def test_fits_now(grant: Grant, mine: list[Member], free: dict[str, int], expected: Grant) -> None:
    assert fits_now(grant, mine, wish("a", grant.ready), free) == expected


def test_a_seat_lists_its_sleepers_in_the_order_the_plan_wakes_them() -> None:
    """The arbiter and `fits_now` check the device of the first sleeper they are given: the seat
    lists sleepers newest first, as `warm_pool.plan` wakes them, so the room checked is where the
    wake then happens. Two sleepers on two devices, the newer on d1."""
    from warm_pool.census import Phase
    from warm_pool.fleet import Devices, Fleet, Footprint
    from warm_pool.fleet_seat import FleetSeat
    from warm_pool.states import Instance, InstanceState

    seat = FleetSeat("chat", Fleet(Devices.cpu_budget(1 << 30)))
    old = Instance(
        "chat-old", "chat", created_at=1.0, max_concurrency=4, state=InstanceState.SLEEPING, device="d0"
    )
    new = Instance(
        "chat-new", "chat", created_at=5.0, max_concurrency=4, state=InstanceState.SLEEPING, device="d1"
    )
    ready = Instance(
        "chat-up", "chat", created_at=0.0, max_concurrency=4, state=InstanceState.READY, device="d0"
    )
    members = seat.members([old, ready, new], {}, Footprint(awake=100, asleep=10))
    assert [(m.id, m.awake) for m in members] == [("chat-up", True), ("chat-new", False), ("chat-old", False)]
    waking = seat.members([old, new], {"chat-old": Phase.WAKING}, Footprint(awake=100, asleep=10))
    assert [(m.id, m.awake, m.holds) for m in waking] == [("chat-old", True, 100), ("chat-new", False, 10)]
