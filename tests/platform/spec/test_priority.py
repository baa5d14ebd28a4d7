"""A request's priority (`stoker.spec.priority`) and a key's priority class (`Limits`): the body's,
else the key's default; below the key's floor, or no priority at all, a 400 naming the field."""

from __future__ import annotations

import pytest

from stoker.errors import APIError
from stoker.spec.keys import Limits, validate_key_request
from stoker.spec.priority import HIGHEST, LOWEST, of_request


@pytest.mark.parametrize(
    ("asked", "default", "floor", "priority"),
    [
        (None, None, None, 0),
        (None, 10, None, 10),  # the key's default where the body names none
        (-3, 10, None, -3),  # the body's own, above or below the default
        (None, 10, 10, 10),
        (20, 10, 10, 20),  # a key may always ask to go later
        (LOWEST, None, None, LOWEST),
        (HIGHEST, None, None, HIGHEST),
    ],
)
def test_a_requests_priority(asked, default, floor, priority) -> None:
    assert of_request(asked, default, floor) == priority


@pytest.mark.parametrize(
    ("asked", "floor", "says"),
    [
        (5, 10, "may not be below this key's floor of 10"),
        (HIGHEST + 1, None, "must be an integer in [-1000, 1000]"),
        (LOWEST - 1, None, "must be an integer in [-1000, 1000]"),
        (1.0, None, "got 1.0"),
        (True, None, "got True"),
        ("0", None, "got '0'"),
    ],
)
def test_a_bad_or_too_low_priority_is_a_400_naming_it(asked, floor, says) -> None:
    with pytest.raises(APIError) as caught:
        of_request(asked, None, floor)
    assert (caught.value.status, caught.value.param) == (400, "priority")
    assert says in caught.value.message


def test_a_key_takes_a_default_and_a_floor_its_default_respects() -> None:
    _, _, limits = validate_key_request(
        {"tenant": "t", "deployments": ["d"], "priority": 10, "priority_min": 5}
    )
    assert (limits.priority, limits.priority_min) == (10, 5)
    assert not limits.any  # a class is no limit: the limiter keeps no state for it
    assert Limits(priority=3).over(Limits(priority=7, priority_min=1)) == Limits(priority=3, priority_min=1)
    for body, param in (
        ({"priority": 1001}, "priority"),
        ({"priority_min": "low"}, "priority_min"),
        ({"priority": 0, "priority_min": 5}, "priority"),  # its own default would be refused
        ({"priority_min": 5}, "priority"),  # so would the default 0
    ):
        with pytest.raises(APIError) as caught:
            validate_key_request({"tenant": "t", "deployments": ["d"], **body})
        assert caught.value.param == param, caught.value.message
