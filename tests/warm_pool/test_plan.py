"""The apply step: a table of (decision, census) → the actions the pool and the simulator carry out."""

from __future__ import annotations

import pytest

from warm_pool.census import Census, Member
from warm_pool.plan import Cancel, Drain, Sleep, Start, TakeBack, Wake, plan


def m(ident: str, created_at: float = 0.0, state_since: float = 0.0) -> Member:
    return Member(ident, created_at=created_at, state_since=state_since)


CASES = [
    # (name, ready, sleeping, census, may_start, can_sleep, outstanding, expected)
    ("steady: nothing to do", 1, 0, Census(routing=(m("r"),)), True, True, {}, []),
    ("up from zero: starts", 2, 0, Census(), True, True, {}, [Start(), Start()]),
    ("up, but starts held back (backoff or corrupt snapshot)", 2, 0, Census(), False, True, {}, []),
    (
        "up: take back the one about to sleep first, then wake, then start",
        3,
        1,
        Census(to_sleep=(m("t"),), asleep=(m("a"),)),
        True,
        True,
        {},
        [TakeBack("t"), Wake("a"), Start()],
    ),
    (
        "up: one falling asleep stands in for a start (woken once asleep)",
        1,
        0,
        Census(falling=(m("f"),)),
        True,
        True,
        {},
        [],
    ),
    (
        "up: wake the newest sleepers first",
        1,
        1,
        Census(asleep=(m("old", 1.0), m("new", 5.0))),
        True,
        True,
        {},
        [Wake("new")],
    ),
    (
        "down: cancel the newest start first",
        1,
        0,
        Census(routing=(m("r", 0.0),), coming=(m("c1", 1.0), m("c2", 2.0))),
        True,
        True,
        {},
        [Cancel("c2"), Cancel("c1")],
    ),
    (
        "down: the least busy READY one sleeps while fewer sleep than asked",
        1,
        1,
        Census(routing=(m("busy", 0.0), m("idle", 0.0))),
        True,
        True,
        {"busy": 3},
        [Sleep("idle")],
    ),
    (
        "down: on a tie, the newest leaves first; beyond the sleeping target it drains",
        0,
        1,
        Census(routing=(m("a", 1.0), m("b", 2.0))),
        True,
        True,
        {},
        [Sleep("b"), Drain("a")],
    ),
    (
        "down: an engine without sleep mode drains, whatever is asked",
        0,
        1,
        Census(routing=(m("r"),)),
        True,
        False,
        {},
        [Drain("r")],
    ),
    (
        "sleepers beyond the target stop, the longest asleep first",
        0,
        1,
        Census(asleep=(m("a", 0.0, 9.0), m("b", 5.0, 2.0), m("c", 1.0, 5.0))),
        True,
        True,
        {},
        [Drain("b", grace=False), Drain("c", grace=False)],
    ),
    (
        "the surplus counts the sleeps just planned; those on the way are not stopped",
        0,
        1,
        Census(routing=(m("r"),), asleep=(m("a"),), to_sleep=(m("t"),)),
        True,
        True,
        {},
        [Drain("r"), Drain("a", grace=False)],
    ),
    (
        "the surplus counts a wake and a take-back as no longer sleeping",
        2,
        0,
        Census(to_sleep=(m("t"),), asleep=(m("a", 1.0, 1.0), m("b", 0.0, 0.0))),
        True,
        True,
        {},
        [TakeBack("t"), Wake("a"), Drain("b", grace=False)],
    ),
]


@pytest.mark.parametrize(
    ("ready", "sleeping", "census", "may_start", "can_sleep", "outstanding", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_plan(ready, sleeping, census, may_start, can_sleep, outstanding, expected):
    got = plan(ready, sleeping, census, can_sleep=can_sleep, may_start=may_start, outstanding=outstanding)
    assert got == expected
