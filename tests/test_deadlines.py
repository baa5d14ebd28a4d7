"""STOKER_TEST_TIMEOUT_FACTOR: read once, refused in one line unless a finite number > 0."""

from __future__ import annotations

import pytest

from tests import deadlines


@pytest.mark.parametrize(("text", "factor"), [("1", 1.0), ("2.5", 2.5), (" 3 ", 3.0), ("0.5", 0.5)])
def test_a_factor_is_a_positive_number(text, factor):
    assert deadlines._factor(text) == factor


@pytest.mark.parametrize("text", ["0", "-1", "", "fast", "nan", "inf"])
def test_anything_else_is_refused_quoting_it(text):
    with pytest.raises(ValueError, match="STOKER_TEST_TIMEOUT_FACTOR must be a finite number > 0") as err:
        deadlines._factor(text)
    assert repr(text) in str(err.value)


def test_every_bound_is_its_base_times_the_factor():
    assert deadlines.deadline(60) == 60 * deadlines.FACTOR
    assert deadlines.PLATFORM_START == deadlines.deadline(60)
    assert deadlines.flag(120) == f"{120 * deadlines.FACTOR:g}s"
