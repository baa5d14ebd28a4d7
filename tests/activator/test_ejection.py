"""Outlier ejection, the pure part: tables and scripts on a logical clock."""

from __future__ import annotations

import pytest

from activator.ejection import (
    HEALTHY,
    EjectionRules,
    Health,
    ejection_s,
    failed,
    probe_due,
    probed,
    succeeded,
)

RULES = EjectionRules(after=3, base_s=10.0, max_s=60.0)


@pytest.mark.parametrize(
    ("ejections", "seconds"),
    [(1, 10.0), (2, 20.0), (3, 40.0), (4, 60.0), (5, 60.0), (1000, 60.0)],
)
def test_each_ejection_in_a_row_lasts_twice_as_long_up_to_the_cap(ejections, seconds) -> None:
    assert ejection_s(RULES, ejections) == seconds


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (HEALTHY, Health(1, 0, None)),
        (Health(1, 0, None), Health(2, 0, None)),
        (Health(2, 0, None), Health(0, 1, 110.0)),  # the third in a row: out for 10 s
        (Health(2, 1, None), Health(0, 2, 120.0)),  # ejected before, no success since: 20 s
        (Health(0, 1, 110.0), Health(0, 1, 110.0)),  # already out: nothing more to count
    ],
)
def test_a_failure_counts_and_the_nth_in_a_row_ejects(before, after) -> None:
    assert failed(before, RULES, now=100.0) == after


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (Health(2, 0, None), HEALTHY),
        (Health(0, 3, None), HEALTHY),  # re-admitted and serving: the doubling starts over
        (Health(0, 1, 110.0), Health(0, 1, 110.0)),  # ejected: only a probe brings it back
    ],
)
def test_a_success_clears_the_count(before, after) -> None:
    assert succeeded(before) == after


@pytest.mark.parametrize(
    ("before", "ok", "now", "after"),
    [
        (HEALTHY, True, 100.0, HEALTHY),
        (Health(2, 0, None), True, 100.0, Health(2, 0, None)),  # /health 200 does not excuse requests
        (Health(2, 0, None), False, 100.0, Health(0, 1, 110.0)),  # a failed probe is a failure
        (Health(0, 1, 110.0), True, 110.0, Health(0, 1, None)),  # time up, 200: back in routing
        (Health(0, 1, 110.0), False, 110.0, Health(0, 2, 130.0)),  # time up, failed: out for 20 s
        (Health(0, 1, 110.0), True, 105.0, Health(0, 1, 110.0)),  # not due yet: ignored
    ],
)
def test_a_probe(before, ok, now, after) -> None:
    assert probed(before, ok, RULES, now) == after


def test_a_stopped_instance_is_out_then_back_after_a_probe_then_out_for_longer() -> None:
    h, now = HEALTHY, 0.0
    for now in (1.0, 2.0, 3.0):  # three timeouts
        h = failed(h, RULES, now)
    assert h.ejected and h.until == 13.0
    assert not probe_due(h, 12.9) and probe_due(h, 13.0)
    h = probed(h, False, RULES, 13.0)  # still stopped
    assert h.until == 33.0
    h = probed(h, True, RULES, 33.0)  # SIGCONT: back
    assert not h.ejected
    for now in (34.0, 35.0, 36.0):  # and fails again before serving anything: 40 s this time
        h = failed(h, RULES, now)
    assert h.until == 76.0
    h = succeeded(probed(h, True, RULES, 76.0))  # back, and serves: forgiven
    assert h == HEALTHY
