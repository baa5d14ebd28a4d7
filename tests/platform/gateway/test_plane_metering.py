"""The gateway-to-controller metering of the split planes (`stoker.gateway.metering`), in tables: the
report's `usage` and `series` checked field by field, the controller's sums over gateways, the
busy-second integral fed by the gateways' reported loads, the gateway's changed-sample diff. The
processes together: tests/platform/serve/test_planes_observability.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from stoker.control.cost import CostMeter
from stoker.control.prices import PriceTable
from stoker.errors import APIError
from stoker.gateway.metering import GatewaySeries, changed_samples, parse_series
from stoker.spec.planes import parse_report
from warm_pool.engine_settings import EngineSettings
from warm_pool.metrics import PoolMetrics
from warm_pool.states import InstanceState as S


def L(**labels: str) -> tuple:
    return tuple(sorted(labels.items()))


OK = ("stoker_requests_total", L(deployment="chat", code="200"))
HELD = ("stoker_queue_length", L(deployment="chat"))


def test_counters_sum_over_every_gateway_gauges_over_the_live_ones():
    series = GatewaySeries()
    series.update("a", [(*OK, 10.0), (*HELD, 2.0)])
    series.update("b", [(*OK, 5.0), (*HELD, 1.0)])
    assert series.reading(["a", "b"]) == {OK: 15.0, HELD: 3.0}
    # b goes silent: what it answered stays answered, what it held is no longer held.
    assert series.reading(["a"]) == {OK: 15.0, HELD: 2.0}
    # Only what changed comes in a report: a's other samples stand.
    series.update("a", [(*OK, 12.0)])
    assert series.reading(["a"]) == {OK: 17.0, HELD: 2.0}


def test_a_gateway_restarted_under_the_same_id_keeps_what_it_counted():
    series = GatewaySeries()
    series.update("a", [(*OK, 40.0)])
    series.update("a", [(*OK, 3.0)])  # its counters began again from zero
    assert series.reading(["a"]) == {OK: 43.0}
    series.update("a", [(*OK, 5.0)])
    assert series.reading(["a"]) == {OK: 45.0}
    series.update("a", [(*HELD, 4.0), (*HELD, 1.0)])  # a gauge going down is just lower
    assert series.reading(["a"])[HELD] == 1.0


def test_gateways_beyond_the_bound_are_folded_keeping_their_counts():
    series = GatewaySeries(max_gateways=2)
    series.update("a", [(*OK, 10.0), (*HELD, 2.0)])
    series.update("b", [(*OK, 5.0)])
    series.update("a", [(*OK, 11.0)])  # a heard again: b is now the least recent
    series.update("c", [(*OK, 1.0), (*HELD, 1.0)])  # a third: b is folded
    assert series.reading(["a", "c"]) == {OK: 17.0, HELD: 3.0}
    series.update("d", [(*OK, 2.0)])  # a is folded: its answers stay, its held ones go
    assert series.reading(["c", "d"]) == {OK: 19.0, HELD: 1.0}


@pytest.mark.parametrize(
    "bad",
    [
        {},  # not a list
        [["stoker_cost_usd_total", {}, 1.0]],  # not one of the gateway's series
        [["stoker_requests_total", {"deployment": "chat"}]],  # no value
        [["stoker_requests_total", {"deployment": 7}, 1.0]],  # a label that is not a string
        [["stoker_requests_total", {"deployment": "chat"}, -1.0]],
        [["stoker_requests_total", {"deployment": "chat"}, True]],
        [["stoker_requests_total", {"deployment": "chat"}, math.inf]],
        [["stoker_requests_total", {"deployment": "x" * 300}, 1.0]],
        [["stoker_requests_total", {f"k{i}": "v" for i in range(9)}, 1.0]],
        [["stoker_queue_length", {"deployment": "chat"}, 1.0]] * 20_001,
    ],
)
def test_bad_series_are_a_400_naming_them(bad):
    with pytest.raises(APIError) as caught:
        parse_series(bad)
    assert caught.value.status == 400 and caught.value.param == "series"


def test_series_parse_to_sorted_labels():
    assert parse_series(None) == []
    assert parse_series([["stoker_requests_total", {"deployment": "chat", "code": "200"}, 3]]) == [(*OK, 3.0)]


def report(**fields) -> dict:
    return {"gateway": "gw", "deployments": {"chat@1": fields}}


@pytest.mark.parametrize(
    "usage",
    [
        [[1.0, 1, 2]],  # three fields
        [[None, 1, 2, 200]],  # no time
        [[1.0, -1, 2, 200]],
        [[1.0, 1, 2.5, 200]],
        [[1.0, 1, True, 200]],
        [[1.0, 1, 2, 99]],  # not an HTTP status
        [[1.0, 1, 10**8, 200]],
        [[-1.0, 1, 2, 200]],
        [[1.0, 1, 2, 200, "a1"]],  # an adapter's name without its revision
        [[1.0, 1, 2, 200, "A B", 1]],  # not a deployment's name
        [[1.0, 1, 2, 200, "a1", 0]],
        [[1.0, 1, 2, 200, "a1", True]],
        "[]",
    ],
)
def test_bad_usage_is_a_400_naming_it(usage):
    with pytest.raises(APIError) as caught:
        parse_report(report(usage=usage))
    assert caught.value.param == "usage"


def test_usage_parses_and_is_optional():
    _, parsed = parse_report(report(usage=[[1700000000.5, 11, 20, 200], [1.0, 3, 4, 200, "a1", 2]]))
    assert parsed["chat@1"]["usage"] == [(1700000000.5, 11, 20, 200), (1.0, 3, 4, 200, "a1", 2)]
    _, older = parse_report(report())  # a gateway from before the meter
    assert older["chat@1"]["usage"] == [] and older["chat@1"]["loads"] == []


@pytest.mark.parametrize(
    "loads",
    [
        [["a1"]],
        [["a1", None]],
        [["a1@x", 0.1]],
        [["a1@0", 0.1]],
        [["a1@\u00b2", 0.1]],
        [["../a", 0.1]],
        [[1, 0.1]],
        "x",
    ],
)
def test_bad_adapter_loads_are_a_400_naming_them(loads):
    with pytest.raises(APIError) as caught:
        parse_report(report(loads=loads))
    assert caught.value.param == "loads"


def test_adapter_loads_parse():
    _, parsed = parse_report(report(loads=[["a1", 0.007], ["a1@3", 0.5]]))
    assert parsed["chat@1"]["loads"] == [("a1", 0.007), ("a1@3", 0.5)]


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_busy_integral_takes_each_live_gateways_reported_load():
    clock = Clock(1000.0)
    meter = CostMeter(PriceTable(), CollectorRegistry(), clock)
    pool = meter.pool_metrics(PoolMetrics(CollectorRegistry()), SimpleNamespace(
        name="chat", revision=1, engine="cpu", snapshot_id="s", engine_settings=EngineSettings()))  # fmt: skip
    pool.set_instances("chat@1", {S.READY: 2})
    live = frozenset({"a", "b"})
    meter.remote_in_flight("chat", "a", 1, live)  # t=1000: one busy
    clock.now = 1010.0
    meter.remote_in_flight("chat", "b", 3, live)  # t=1010: 4 requests, 2 instances: both busy
    clock.now = 1015.0
    meter.remote_in_flight("chat", "a", 0, frozenset({"a"}))  # b went silent: it counts none
    clock.now = 1030.0
    pool.add_instance_seconds("chat", S.READY, 60.0)  # two READY for 30 s
    [row] = meter.report()
    busy = 10 * 1 + 5 * 2  # then nothing from 1015 on
    assert row["idle_seconds"] == pytest.approx(60 - busy)
    # Answers reported by the gateways are counted as the one-process meter counts them.
    meter.record("chat", 1, 1700000000.0, 11, 20, 200)
    [row] = meter.report()
    assert (row["requests"], row["tokens_in"], row["tokens_out"]) == (1, 11, 20)


def test_a_gateway_sends_the_series_that_changed_since_its_last_delivered_report():
    registry = CollectorRegistry()
    answered = Counter("stoker_requests", "", ["deployment", "code"], registry=registry)
    held = Gauge("stoker_queue_length", "", ["deployment"], registry=registry)
    Counter("stoker_other", "", ["deployment"], registry=registry).labels("chat").inc()
    answered.labels("chat", "200").inc(3)
    held.labels("chat").set(1)
    first = changed_samples(registry, {})
    assert sorted(first) == [
        ["stoker_queue_length", {"deployment": "chat"}, 1.0],
        ["stoker_requests_total", {"code": "200", "deployment": "chat"}, 3.0],
    ]
    sent = {(name, tuple(sorted(labels.items()))): v for name, labels, v in first}
    held.labels("chat").set(0)
    assert changed_samples(registry, sent) == [["stoker_queue_length", {"deployment": "chat"}, 0.0]]


@pytest.mark.parametrize("adapters", [["A B"], ["a1@2"], [1], ["x" * 64], "a1", ["a"] * 1001])
def test_bad_adapter_arrivals_are_a_400_naming_them(adapters):
    with pytest.raises(APIError) as caught:
        parse_report(report(adapters=adapters))
    assert caught.value.param == "adapters"


def test_adapter_arrivals_parse_each_name_once_and_a_gateway_keeps_them_until_they_get_through():
    from stoker.gateway.plane import RemoteSource

    _, parsed = parse_report(report(adapters=["a1", "a2", "a1"]))
    assert parsed["chat@1"]["adapters"] == ["a1", "a2"]
    assert parse_report(report())[1]["chat@1"]["adapters"] == []  # a gateway from before
    source = RemoteSource(lambda: None)
    for name in ("a1", "a2", "a1"):
        source.adapter_arrived(name)
    news = source.take()
    assert news["adapters"] == ["a1", "a2"] and source.take()["adapters"] == []
    source.adapter_arrived("a3")
    source.give_back(news)  # that report failed: its names go into the next one
    assert sorted(source.take()["adapters"]) == ["a1", "a2", "a3"]
