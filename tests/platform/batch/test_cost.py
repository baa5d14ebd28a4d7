"""A batch's cost: its tokens' share of what its deployments spent since it began (`stoker.batch.cost`)."""

from __future__ import annotations

import pytest

from stoker.batch.cost import batch_cost, figures


def row(name: str, usd: float, storage: float, tokens_in: int, tokens_out: int) -> dict:
    return {
        "deployment": name,
        "cost_usd": usd,
        "storage_usd": storage,
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
    }


def test_the_worked_example():
    base = figures([row("chat", 1.00, 0.10, 5_000, 5_000)])
    now = figures([row("chat", 1.32, 0.12, 9_000, 11_000)])  # $0.30 of instances, 10,000 tokens since
    assert batch_cost(now, base, {"chat": 4_000}) == pytest.approx(0.12)


def test_alone_it_pays_for_everything_and_never_more():
    base = figures([row("chat", 0.0, 0.0, 0, 0)])
    now = figures([row("chat", 0.50, 0.0, 300, 700)])
    assert batch_cost(now, base, {"chat": 1_000}) == pytest.approx(0.50)
    # Its own count above the meter's (a stream's estimate, a lagging checkpoint): the whole spend.
    assert batch_cost(now, base, {"chat": 5_000}) == pytest.approx(0.50)


def test_each_deployment_is_shared_on_its_own():
    base = figures([row("a", 1.0, 0.0, 100, 0)])  # b began after the batch: no base, all since
    now = figures([row("a", 2.0, 0.0, 1_100, 0), row("b", 0.4, 0.0, 200, 0)])
    assert batch_cost(now, base, {"a": 500, "b": 100, "gone": 50}) == pytest.approx(0.5 + 0.2)


def test_a_meter_behind_its_base_counts_nothing_spent():
    base = figures([row("chat", 2.0, 0.0, 1_000, 0)])
    now = figures([row("chat", 1.5, 0.0, 900, 0)])  # restored from an older checkpoint
    assert batch_cost(now, base, {"chat": 10}) == 0.0
    assert batch_cost(now, base, {}) == 0.0
