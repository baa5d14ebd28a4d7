"""The recycle decision (`warm_pool.recycle`): pure functions on a logical clock, as tables."""

from __future__ import annotations

import math

import pytest

from warm_pool.errors import InvalidConfig
from warm_pool.recycle import (
    MIN_MAX_AGE_S,
    Aged,
    Recycle,
    RecycleConfig,
    RecycleState,
    begin,
    due_at,
    max_age_error,
    settle,
)

C = RecycleConfig(max_age_s=100.0, jitter=0.1, retry_s=30.0)
NO_JITTER = RecycleConfig(max_age_s=100.0, jitter=0.0)


def test_an_instance_is_due_within_the_jitter_before_its_max_age_always_at_the_same_time():
    dues = [due_at(f"d-{i:08x}", 0.0, C) for i in range(200)]
    assert all(90.0 < d <= 100.0 for d in dues)
    assert max(dues) - min(dues) > 5.0  # spread: the same age does not mean the same second
    assert dues == [due_at(f"d-{i:08x}", 0.0, C) for i in range(200)]  # a function of the id
    assert due_at("d-1", 50.0, NO_JITTER) == 150.0  # counted from READY first


@pytest.mark.parametrize(
    ("routing", "last_ready", "now", "old"),
    [
        ([Aged("a", 0.0)], 1, 99.0, None),  # not due yet
        ([Aged("a", 0.0)], 1, 100.0, "a"),  # due
        ([Aged("a", 0.0), Aged("b", -50.0)], 2, 100.0, "b"),  # the most overdue first
        ([Aged("a", 0.0), Aged("b", 10.0)], 2, 200.0, "a"),
        ([Aged("a", 0.0)], 0, 100.0, None),  # the pool is scaling down: no recycle begins
        ([Aged("a", 0.0)], None, 100.0, None),  # no decision yet
        ([Aged("a", 0.0)], 3, 100.0, "a"),  # scaling up: it may
        ([], 1, 100.0, None),
    ],
)
def test_a_recycle_begins_with_the_most_overdue_instance_unless_the_pool_scales_down(
    routing, last_ready, now, old
):
    state, outcome = begin(routing, last_ready, RecycleState(), now, NO_JITTER)
    assert outcome is None
    if old is None:
        assert state.current is None
    else:
        assert state.current == Recycle(old, now, len(routing))


def test_one_recycle_at_a_time_and_none_while_one_is_held_off():
    routing = [Aged("a", 0.0), Aged("b", 0.0)]  # both due
    state, _ = begin(routing, 2, RecycleState(), 100.0, NO_JITTER)
    again, outcome = begin(routing, 2, state, 101.0, NO_JITTER)
    assert again == state and outcome is None  # still the first one; the other waits its turn
    held = RecycleState(None, not_before=130.0)
    assert begin(routing, 2, held, 129.0, NO_JITTER)[0].current is None
    assert begin(routing, 2, held, 130.0, NO_JITTER)[0].current is not None


def test_a_recycle_whose_old_instance_left_routing_otherwise_is_lost():
    state = RecycleState(Recycle("a", 100.0, 2))
    after, outcome = begin([Aged("b", 0.0)], 2, state, 105.0, NO_JITTER)
    assert (after.current, outcome) == (None, "lost")


# (before, others READY, wanted, granted) -> (retire?, outcome)
@pytest.mark.parametrize(
    ("before", "others", "wanted", "granted", "retire", "outcome"),
    [
        (2, 1, 2, 2, False, None),  # the replacement is not READY yet: the old one serves on
        (2, 2, 2, 2, True, "replaced"),  # READY: the old one goes, READY stays at 2
        (1, 0, 1, 1, False, None),
        (1, 1, 1, 1, True, "replaced"),
        (2, 2, 3, 3, False, None),  # scaling up meanwhile: the old one serves until all are up
        (2, 3, 3, 3, True, "replaced"),
        (2, 2, 3, 2, True, "replaced"),  # the fleet grants no third: the old one's memory is needed
        (2, 1, 2, 1, False, "no_room"),  # no device memory for the replacement: wait, counted
        (2, 1, 1, 1, False, "called_off"),  # the policy scales down: called off
        (2, 0, 0, 0, False, "called_off"),
    ],
)
def test_the_old_instance_is_retired_only_once_the_others_are_as_many_as_before(
    before, others, wanted, granted, retire, outcome
):
    state = RecycleState(Recycle("old", 100.0, before))
    settled = settle(state, others, wanted, granted, 110.0, C)
    assert (settled.retire, settled.outcome) == ("old" if retire else None, outcome)
    if outcome == "called_off":
        assert settled.state == RecycleState(None, not_before=110.0 + C.retry_s)
    elif retire:
        assert settled.state.current is None
    else:
        assert settled.state.current is not None


def test_a_recycle_called_off_on_the_call_that_began_it_asked_for_nothing_and_is_not_counted():
    state = RecycleState(Recycle("old", 110.0, 2))
    settled = settle(state, 1, 1, 1, 110.0, C)
    assert settled == (RecycleState(None, not_before=110.0 + C.retry_s), None, None)


def test_waiting_for_room_is_counted_once_per_recycle():
    state = RecycleState(Recycle("old", 100.0, 2))
    first = settle(state, 1, 2, 1, 101.0, C)
    second = settle(first.state, 1, 2, 1, 102.0, C)
    assert (first.outcome, second.outcome) == ("no_room", None)
    done = settle(second.state, 2, 2, 2, 103.0, C)
    assert (done.retire, done.outcome) == ("old", "replaced")


def test_no_recycle_under_way_settles_to_nothing():
    assert settle(RecycleState(), 1, 1, 1, 0.0, C) == (RecycleState(), None, None)


@pytest.mark.parametrize(
    ("value", "allow_zero", "ok"),
    [
        (MIN_MAX_AGE_S, False, True),
        (3600.0, False, True),
        (0.0, True, True),
        (0.0, False, False),
        (MIN_MAX_AGE_S - 1, True, False),
        (-5.0, True, False),
        (math.inf, False, False),
        (True, False, False),
        ("1h", False, False),
    ],
)
def test_a_max_age_is_zero_for_off_where_allowed_or_at_least_the_floor(value, allow_zero, ok):
    message = max_age_error(value, allow_zero=allow_zero)
    assert (message is None) == ok
    if not ok:
        assert repr(value) in message and f"{MIN_MAX_AGE_S:g}s" in message


def test_the_config_refuses_what_would_stampede_or_never_end():
    with pytest.raises(InvalidConfig, match="at least 10s"):
        RecycleConfig(max_age_s=1.0)
    with pytest.raises(InvalidConfig, match="jitter"):
        RecycleConfig(max_age_s=60.0, jitter=1.0)
