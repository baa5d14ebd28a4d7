"""Restart delays: doubling from 1 s, capped at 60 s."""

from __future__ import annotations

import pytest

from warm_pool.backoff import restart_delay


@pytest.mark.parametrize(
    ("restarts", "delay"),
    [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (5, 32.0), (6, 60.0), (7, 60.0), (500, 60.0)],
)
def test_default_delays(restarts, delay):
    assert restart_delay(restarts) == delay


def test_initial_and_cap():
    assert [restart_delay(n, initial_s=0.5, cap_s=3.0) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_negative_restarts_are_refused():
    with pytest.raises(ValueError, match="restarts must be >= 0, got -1"):
        restart_delay(-1)
