"""`stoker.control.history`: the last hour, from readings of the metrics registry. The point between two
readings as a pure function (tables), the bounded series on a logical clock, the sampler reading a
real registry that the activator's and the pool's metrics write to."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from activator import ActivatorMetrics
from stoker.control.history import History, HistoryConfig, HistorySampler, point
from stoker.gateway.metering import read_registry
from warm_pool.metrics import PoolMetrics
from warm_pool.states import InstanceState


def r(**series: dict[tuple, float]) -> dict:
    """A reading: r(stoker_queue_length={(("deployment", "chat"),): 2.0})."""
    return {(name, labels): v for name, samples in series.items() for labels, v in samples.items()}


def L(**labels: str) -> tuple:
    return tuple(sorted(labels.items()))


CHAT = L(deployment="chat")
BEFORE = r(
    stoker_requests_total={L(deployment="chat", code="200"): 100.0, L(deployment="chat", code="503"): 2.0},
    stoker_cold_start_requests_total={L(deployment="chat", tier="disk"): 1.0},
    stoker_instance_startup_seconds_sum={L(deployment="chat", tier="disk"): 9.0},
    stoker_instance_startup_seconds_count={L(deployment="chat", tier="disk"): 1.0},
    stoker_queue_wait_seconds_sum={CHAT: 10.0},
    stoker_queue_wait_seconds_count={CHAT: 1.0},
    stoker_instance_seconds_total={L(deployment="chat", state="READY"): 50.0},
    stoker_scaler_arrivals_total={CHAT: 90.0},
)
NOW = r(
    stoker_requests_total={
        L(deployment="chat", code="200"): 113.0,
        L(deployment="chat", code="503"): 4.0,
        L(deployment="code", code="200"): 5.0,  # new since BEFORE: counted from zero
    },
    stoker_cold_start_requests_total={
        L(deployment="chat", tier="disk"): 1.0,
        L(deployment="chat", tier="wake"): 3.0,
    },
    stoker_instance_startup_seconds_sum={
        L(deployment="chat", tier="disk"): 9.0,
        L(deployment="chat", tier="wake"): 0.9,
    },
    stoker_instance_startup_seconds_count={
        L(deployment="chat", tier="disk"): 1.0,
        L(deployment="chat", tier="wake"): 2.0,
    },
    stoker_queue_wait_seconds_sum={CHAT: 17.0},
    stoker_queue_wait_seconds_count={CHAT: 3.0},
    stoker_instance_seconds_total={
        L(deployment="chat", state="READY"): 60.0,
        L(deployment="chat", state="SLEEPING"): 5.0,
    },
    stoker_scaler_forecast_requests_per_second={CHAT: 2.5},
    stoker_scaler_arrivals_total={CHAT: 106.0},
    stoker_queue_length={CHAT: 1.0},
    stoker_instances={
        L(deployment="chat", state="READY"): 2.0,
        L(deployment="chat", state="SLEEPING"): 1.0,
        L(deployment="chat", state="STOPPED"): 0.0,
        L(deployment="code", state="READY"): 0.0,
    },
)


def test_a_point_is_the_deltas_over_the_interval():
    p = point(BEFORE, NOW, 5.0)
    assert p["chat"] == {
        "requests_per_s": 3.0,  # answered: (113 + 4) - (100 + 2) = 15 over 5 s
        "arrivals_per_s": 3.2,  # heard of by the scaler, held ones too: 106 - 90 = 16 over 5 s
        "errors_per_s": 0.4,  # 2 more 503s
        "forecast_per_s": 2.5,
        "queued": 1,
        "instances": {"READY": 2, "SLEEPING": 1},
        "cold_starts": {"wake": 3},  # disk did not move
        "start_s": {"wake": 0.45},  # 0.9 s over 2 wakes
        "hold_s": 3.5,  # 7 s over 2 holds
        "instance_seconds": {"READY": 10.0, "SLEEPING": 5.0},
        "cost_usd": None,  # no cost metric registered
    }
    assert p["code"]["requests_per_s"] == 1.0 and p["code"]["hold_s"] is None


@pytest.mark.parametrize(
    ("before", "now", "expected"),
    [
        # A counter that went down was reset (the process restarted): its value is the delta.
        ({L(deployment="chat", code="200"): 500.0}, {L(deployment="chat", code="200"): 20.0}, 4.0),
        ({L(deployment="chat", code="200"): 20.0}, {L(deployment="chat", code="200"): 20.0}, 0.0),
    ],
)
def test_counter_resets_count_from_zero(before, now, expected):
    instances = {L(deployment="chat", state="READY"): 1.0}
    p = point(r(stoker_requests_total=before), r(stoker_requests_total=now, stoker_instances=instances), 5.0)
    assert p["chat"]["requests_per_s"] == expected


def test_cost_is_summed_by_deployment_when_the_cost_metric_exists():
    cost = "stoker_cost_usd_total"
    before = r(**{cost: {L(deployment="chat", revision="1", state="READY"): 1.0}})
    now = r(
        **{
            cost: {
                L(deployment="chat", revision="1", state="READY"): 1.5,
                L(deployment="chat", revision="2", state="SLEEPING"): 0.25,
            }
        },
        stoker_instances={L(deployment="chat", state="READY"): 1.0},
    )
    assert point(before, now, 10.0)["chat"]["cost_usd"] == 0.75


def test_a_removed_deployment_leaves_the_points():
    # Its counters stay (history) but its gauges went with it, and nothing moved.
    before = r(stoker_requests_total={L(deployment="gone", code="200"): 7.0})
    now = r(stoker_requests_total={L(deployment="gone", code="200"): 7.0})
    assert point(before, now, 5.0) == {}


def test_the_series_is_bounded_and_the_first_reading_is_the_baseline():
    history = History(HistoryConfig(interval_s=5.0, window_s=20.0))  # 4 points
    for i in range(7):
        reading = r(
            stoker_requests_total={L(deployment="chat", code="200"): 10.0 * i},
            stoker_instances={L(deployment="chat", state="READY"): 1.0},
        )
        history.record(reading, now=100.0 + 5 * i, wall=1_700_000_000.0 + 5 * i)
    points = history.snapshot()["points"]
    assert len(points) == 4
    assert [p["t"] for p in points] == [1_700_000_000.0 + 5 * i for i in (3, 4, 5, 6)]
    assert all(p["deployments"]["chat"]["requests_per_s"] == 2.0 and p["dt"] == 5.0 for p in points)
    assert [p["t"] for p in history.snapshot(since=1_700_000_025.0)["points"]] == [1_700_000_030.0]


def test_a_reading_at_the_same_instant_adds_no_point():
    history = History(HistoryConfig())
    history.record({}, now=1.0, wall=1.0)
    history.record({}, now=1.0, wall=1.0)
    assert history.snapshot()["points"] == []


@pytest.mark.parametrize(
    ("environ", "interval", "error"),
    [
        ({}, 5.0, None),
        ({"STOKER_HISTORY_INTERVAL": "0.5"}, 0.5, None),
        ({"STOKER_HISTORY_INTERVAL": "0.01"}, None, r"\[0.1, 300\] s, got 0.01"),
        ({"STOKER_HISTORY_INTERVAL": "soon"}, None, "number of seconds, got 'soon'"),
    ],
)
def test_the_interval_comes_from_the_environment(environ, interval, error):
    if error:
        with pytest.raises(ValueError, match=error):
            HistoryConfig.from_env(environ)
    else:
        config = HistoryConfig.from_env(environ)
        assert config.interval_s == interval and config.max_points == int(3600 / interval)


def test_the_sampler_reads_what_the_activator_and_the_pool_write():
    registry = CollectorRegistry()
    activator, pool = ActivatorMetrics(registry), PoolMetrics(registry)
    now = [0.0]
    sampler = HistorySampler(
        registry, HistoryConfig(interval_s=1.0), clock=lambda: now[0], wall=lambda: 1e9 + now[0]
    )
    pool.set_instances("chat@1", {InstanceState.READY: 1, InstanceState.SLEEPING: 0})
    sampler.sample()
    for _ in range(6):
        activator.requests.labels("chat", "200").inc()
    activator.queue_wait.labels("chat").observe(1.5)
    pool.cold_request("chat", "wake")
    pool.observe_startup("chat", "wake", 0.3)
    pool.decided("chat@1", 1, 0, 4.0)
    now[0] = 2.0
    sampler.sample()
    [p] = sampler.history.snapshot()["points"]
    chat = p["deployments"]["chat"]
    assert (chat["requests_per_s"], chat["hold_s"], chat["forecast_per_s"]) == (3.0, 1.5, 4.0)
    assert (chat["cold_starts"], chat["start_s"], chat["instances"]) == (
        {"wake": 1},
        {"wake": 0.3},
        {"READY": 1},
    )
    assert ("stoker_requests_total", L(code="200", deployment="chat")) in read_registry(registry)
