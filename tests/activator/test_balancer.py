"""`pick`: least outstanding among the endpoints with room, ties rotated from `start`. A table."""

from __future__ import annotations

import pytest

from activator.balancer import pick
from tests.activator.conftest import Ep

A, B, C = Ep("a", "u", 2), Ep("b", "u", 2), Ep("c", "u", 1)

CASES = [
    # endpoints, outstanding, start, expected id
    ([], {}, 0, None),
    ([A], {}, 0, "a"),
    ([A], {"a": 2}, 0, None),  # full
    ([A, B], {"a": 1}, 0, "b"),  # fewest outstanding
    ([A, B], {"b": 1}, 0, "a"),
    ([A, B], {}, 0, "a"),  # tie: scan from start
    ([A, B], {}, 1, "b"),
    ([A, B], {}, 2, "a"),  # start wraps around
    ([A, B], {}, -1, "b"),
    ([A, B, C], {"a": 1, "b": 1}, 1, "c"),
    ([A, B, C], {"a": 1, "b": 1, "c": 1}, 2, "a"),  # c is full; a and b tie, scan from c → a
    ([A, B, C], {"a": 1, "b": 1, "c": 1}, 1, "b"),
    ([A, B, C], {"a": 2, "b": 2, "c": 1}, 0, None),  # all full
    ([A, B], {"a": 0, "b": 5, "zzz": 0}, 1, "a"),  # over-full and unknown ids are harmless
    ([Ep("z", "u", 0)], {}, 0, None),  # a limit of 0 takes nothing
]


@pytest.mark.parametrize(("endpoints", "outstanding", "start", "expected"), CASES)
def test_pick(endpoints, outstanding, start, expected) -> None:
    chosen = pick(endpoints, outstanding, start)
    assert (chosen.id if chosen else None) == expected


def test_rotating_start_shares_ties_evenly() -> None:
    endpoints = [Ep(str(i), "u", 10) for i in range(3)]
    counts = {"0": 0, "1": 0, "2": 0}
    for turn in range(30):
        counts[pick(endpoints, {}, turn).id] += 1
    assert counts == {"0": 10, "1": 10, "2": 10}
