"""How many batch lines may go now (`stoker.batch.pacing`): tables, no clock."""

from __future__ import annotations

import pytest

from stoker.batch.pacing import Room, allowance, urgent


@pytest.mark.parametrize(
    ("room", "mine", "urgent_", "concurrency", "expected", "why"),
    [
        (Room(8, 0, 0, 0), 0, False, 8, 4, "an idle instance: half its 8 slots"),
        (Room(8, 1, 0, 0), 0, False, 8, 3, "one interactive request in flight takes one of the four"),
        (Room(8, 4, 0, 0), 0, False, 8, 0, "interactive traffic fills the batch's half"),
        (Room(8, 4, 0, 4), 4, False, 8, 0, "the batch's own four fill it"),
        (Room(8, 3, 0, 2), 2, False, 8, 1, "one interactive and two batch lines: one more"),
        (Room(8, 2, 1, 0), 0, False, 8, 0, "an interactive request is held: it goes first"),
        (Room(8, 8, 1, 1), 1, False, 8, 0, "held lines are the batch's own: still full"),
        (Room(0, 0, 0, 0), 0, False, 8, 1, "at zero: one line, whose hold brings an instance up"),
        (Room(0, 0, 1, 1), 1, False, 8, 0, "at zero with a line already held: wait for it"),
        (Room(0, 0, 1, 1), 0, False, 8, 0, "at zero with another batch's line held: wait for it too"),
        (Room(1, 0, 0, 0), 0, False, 8, 1, "one slot: at least one line, or a batch never runs"),
        (Room(8, 8, 5, 0), 0, True, 2, 2, "urgent: its own concurrency, whatever the room"),
        (None, 0, False, 8, 1, "no such deployment here: one at a time (each answered 404)"),
        (Room(64, 0, 0, 0), 0, False, 2, 2, "never past its own concurrency"),
    ],
)
def test_allowance(room, mine, urgent_, concurrency, expected, why):
    assert allowance(room, mine, 0.5, concurrency, urgent_) == expected, why


@pytest.mark.parametrize(
    ("remaining", "rate", "time_left", "expected"),
    [
        (1000, 2.0, 900, True),  # needs 500 s: more than half of 900
        (1000, 2.0, 1200, False),
        (0, None, 0, False),  # nothing left
        (10, None, 0, True),  # out of time
        (10, None, 80_000, False),  # no rate yet, early in a 24 h window
        (10, None, 20_000, True),  # no rate yet, in its last quarter
    ],
)
def test_urgent(remaining, rate, time_left, expected):
    assert urgent(remaining, rate, time_left, 86_400) is expected
