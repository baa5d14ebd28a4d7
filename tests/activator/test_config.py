"""`ActivatorConfig`: defaults that cover a cold start; bad values refused with value and range."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from activator.config import ActivatorConfig
from stoker.cli.parser import duration_or_off


def test_defaults_cover_a_vllm_cold_start() -> None:
    config = ActivatorConfig()
    assert config.hold_deadline_s >= 90  # vLLM's slow end
    assert config.max_queued == 100 and config.retry_after_s == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_queued = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_queued", -1, "max_queued must be an integer in [0, 1000000], got -1"),
        ("max_queued", 1.5, "got 1.5"),
        ("max_queued", True, "got True"),
        ("retry_after_s", 0, "retry_after_s must be an integer in [1, 3600], got 0"),
        ("hold_deadline_s", 0, "hold_deadline_s must be a finite number of seconds > 0, got 0"),
        ("hold_deadline_s", float("inf"), "got inf"),
        (
            "keepalive_interval_s",
            -5.0,
            "keepalive_interval_s must be a finite number of seconds > 0, got -5.0",
        ),
        ("connect_timeout_s", float("nan"), "connect_timeout_s"),
        ("first_byte_timeout_s", "300", "got '300'"),
        ("chunk_gap_timeout_s", None, "chunk_gap_timeout_s must be a finite number of seconds > 0, got None"),
    ],
)
def test_bad_values_are_refused_with_value_and_range(field, value, message) -> None:
    with pytest.raises(ValueError, match=f"^{field}") as info:
        ActivatorConfig(**{field: value})
    assert message in str(info.value)


def test_zero_queue_and_fractional_seconds_are_allowed() -> None:
    config = ActivatorConfig(max_queued=0, hold_deadline_s=0.25, keepalive_interval_s=1)
    assert config.max_queued == 0 and config.keepalive_interval_s == 1


def test_keepalives_can_be_off_but_not_zero() -> None:
    assert ActivatorConfig(keepalive_interval_s=None).keepalive_interval_s is None
    with pytest.raises(
        ValueError, match="keepalive_interval_s must be a finite number of seconds > 0, got 0"
    ):
        ActivatorConfig(keepalive_interval_s=0)


@pytest.mark.parametrize(
    ("flag", "seconds"),
    [("off", None), ("OFF", None), ("0", None), ("0s", None), ("5s", 5.0), ("250ms", 0.25)],
)
def test_the_keepalive_flag_takes_a_duration_or_off(flag, seconds) -> None:
    """`stoker up --keepalive-interval`: `off` and zero switch keep-alives off (None in the config)."""
    assert duration_or_off(flag) == seconds


def test_the_keepalive_flag_refuses_other_words() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="'never' is not a duration"):
        duration_or_off("never")
