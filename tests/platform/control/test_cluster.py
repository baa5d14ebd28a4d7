"""The two planes' contract, pure parts (`stoker.control.cluster`, `stoker.gateway.plane`): how an instance's
concurrency is split, how gateways' reports add up into a pool's demand, what a report may hold,
and how a key's limits are split. The processes are `test_planes.py`'s."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from stoker.control.cluster import GatewayLoad, RoutingTable
from stoker.errors import APIError
from stoker.gateway.plane import KeyTable, RemoteSource
from stoker.spec.keys import hash_key
from stoker.spec.planes import parse_report, share


@pytest.mark.parametrize(
    ("concurrency", "gateways", "shares"),
    [
        (8, ["a", "b"], [4, 4]),
        (8, ["a", "b", "c"], [3, 3, 2]),  # the remainder to the first by name: the sum is 8
        (1, ["a", "b"], [1, 1]),  # at least one each: two gateways may put two on it
        (8, ["a"], [8]),
    ],
)
def test_an_instance_is_split_between_the_live_gateways(concurrency, gateways, shares):
    assert [share(concurrency, gateways, g) for g in gateways] == shares


def test_a_gateway_not_yet_counted_gets_a_share_as_if_it_were():
    assert share(8, ["a"], "b") == 4


@dataclass
class Endpoint:
    id: str


@dataclass
class Pool:
    routing: list[str] = field(default_factory=list)
    heard: list[str] = field(default_factory=list)

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(i) for i in self.routing]

    def request_arrived(self) -> None:
        self.heard.append("arrived")

    def request_finished(self, service_s, cold_on) -> None:
        self.heard.append(f"finished {service_s} {cold_on}")

    def report_failure(self, ident: str) -> None:
        self.heard.append(f"failure {ident}")

    def report_unhealthy(self, ident: str, reason: str) -> None:
        self.heard.append(f"unhealthy {ident} {reason}")

    def poke(self) -> None:
        self.heard.append("poke")


def report(**fields) -> dict:
    _, parsed = parse_report({"gateway": "g", "deployments": {"m@1": fields}})
    return parsed["m@1"]


def test_gateways_reports_add_up_and_a_silent_gateway_stops_counting():
    clock = [100.0]
    table = RoutingTable(lambda: clock[0], stale_after_s=5, silent_grace_s=0)
    demand = GatewayLoad("m", table, lambda: clock[0])
    demand.pool = pool = Pool(routing=["i1"])
    demand.report(
        "a", report(in_flight=2, queued=1, outstanding={"i1": 2}, routing=["i1"], since_arrival_s=1), 100
    )
    clock[0] = 103.0
    demand.report("b", report(in_flight=1, outstanding={"i1": 1}, routing=["i1"], since_arrival_s=0.5), 103)
    load = demand.load()
    assert (load.in_flight, load.queued, load.outstanding, load.last_arrival) == (3, 1, {"i1": 3}, 102.5)
    clock[0] = 106.0  # a's report is 6 s old: a is gone
    assert (demand.load().in_flight, demand.load().outstanding) == (1, {"i1": 1})
    assert pool.heard == []


def test_a_gateway_busy_when_it_went_silent_counts_as_busy_for_the_grace():
    """Cut off by the network (or the controller stopped), a gateway goes on serving by its last
    table: its requests in flight must not let the instance under them scale down as idle. An
    idle one stops counting when it goes stale; a busy one after the grace."""
    clock = [100.0]
    table = RoutingTable(lambda: clock[0], stale_after_s=5, silent_grace_s=30)
    demand = GatewayLoad("m", table, lambda: clock[0])
    demand.pool = Pool(routing=["i1"])
    demand.report("a", report(in_flight=2, outstanding={"i1": 2}, routing=["i1"], since_arrival_s=1), 100)
    demand.report("b", report(routing=["i1"], since_arrival_s=50), 100)
    clock[0] = 120.0  # both stale: b was idle, a busy
    load = demand.load()
    assert (load.in_flight, load.outstanding, load.last_arrival) == (2, {"i1": 2}, 120.0)
    clock[0] = 131.0  # past the grace: a is taken for gone
    load = demand.load()
    assert (load.in_flight, load.outstanding, load.last_arrival) == (0, {}, None)
    assert (
        RoutingTable(stale_after_s=5).silent_grace_s == 60
        and RoutingTable(stale_after_s=10).silent_grace_s == 100
    )


def test_an_instance_out_of_routing_is_busy_until_every_gateway_has_seen_it_go():
    table = RoutingTable(lambda: 0.0)
    demand = GatewayLoad("m", table, lambda: 0.0)
    demand.pool = Pool(routing=[])  # i1 left routing at the controller
    demand.report("a", report(routing=["i1"]), 0.0)  # a has not heard yet, and reports nothing on it
    demand.report("b", report(routing=[]), 0.0)
    assert demand.load().outstanding == {"i1": 1}
    demand.report("a", report(routing=[]), 0.0)
    assert demand.load().outstanding == {}


def test_a_reports_news_reaches_the_pool_once():
    demand = GatewayLoad("m", RoutingTable(lambda: 0.0), lambda: 0.0)
    demand.pool = pool = Pool()
    demand.report(
        "a",
        report(
            arrivals=2,
            finished=[[0.5, "i1"], [None, None]],
            failures=["i2"],
            unhealthy=[["i3", "503"]],
            poke=True,
        ),
        0.0,
    )
    assert pool.heard == [
        "arrived",
        "arrived",
        "finished 0.5 i1",
        "finished None None",
        "failure i2",
        "unhealthy i3 503",
        "poke",
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"deployments": {}}, "gateway"),
        ({"gateway": "../x", "deployments": {}}, "gateway"),
        ({"gateway": "g", "deployments": []}, "deployments"),
        ({"gateway": "g", "deployments": {"Bad Name": {}}}, "deployments"),
        ({"gateway": "g", "deployments": {"m": {}}}, "deployments"),  # no revision
        ({"gateway": "g", "deployments": {"m@0": {}}}, "deployments"),
        ({"gateway": "g", "deployments": {"m@1": {"answers": [[200]]}}}, "answers"),
        ({"gateway": "g", "deployments": {"m@1": {"answers": [[99, 0.1]]}}}, "answers"),
        ({"gateway": "g", "deployments": {"m@1": {"answers": [[200, -1]]}}}, "answers"),
        ({"gateway": "g", "deployments": {"m@1": {"in_flight": -1}}}, "in_flight"),
        ({"gateway": "g", "deployments": {"m@1": {"queued": True}}}, "queued"),
        ({"gateway": "g", "deployments": {"m@1": {"since_arrival_s": float("nan")}}}, "since_arrival_s"),
        ({"gateway": "g", "deployments": {"m@1": {"finished": [[1.0]]}}}, "finished"),
        ({"gateway": "g", "deployments": {"m@1": {"finished": [[0.1, None]] * 10_001}}}, "finished"),
        ({"gateway": "g", "deployments": {"m@1": {"outstanding": {"i": "1"}}}}, "outstanding"),
        ({"gateway": "g", "deployments": {"m@1": {"routing": ["x" * 200]}}}, "routing"),
        ({"gateway": "g", "deployments": {"m@1": {"poke": "yes"}}}, "poke"),
    ],
)
def test_a_bad_report_is_refused_naming_the_field(body, param):
    with pytest.raises(APIError) as err:
        parse_report(body)
    assert (err.value.status, err.value.param) == (400, param)


async def test_gateways_wait_for_a_newer_table_and_a_restarted_controller_answers_at_once():
    table = RoutingTable(lambda: 0.0)
    assert await table.wait("another-epoch", 10**6, 5)  # a restarted controller: at once
    assert not await table.wait(table.epoch, table.version, 0.05)  # nothing new: the poll times out
    waiter = asyncio.create_task(table.wait(table.epoch, table.version, 5))
    await asyncio.sleep(0)
    table.bump()
    assert await waiter


def test_a_keys_limits_are_split_between_the_gateways():
    keys = KeyTable()
    record = {"id": "k1", "tenant": "t", "deployments": ["m"], "created": 0.0, "hash": hash_key("sk-1")}
    keys.replace([{**record, "rps": 10.0, "tpm": 1000, "max_concurrent": 3}], gateways=2)
    found = keys.lookup("sk-1")
    assert (found.limits.rps, found.limits.tpm, found.limits.max_concurrent) == (5.0, 500, 2)
    assert keys.lookup("sk-2") is None and len(keys) == 1
    # A priority class is no amount: every gateway keeps the key's whole default and floor.
    keys.replace([{**record, "priority": 10, "priority_min": 5}], gateways=3)
    found = keys.lookup("sk-1")
    assert (found.limits.priority, found.limits.priority_min) == (10, 5)


def test_a_report_that_did_not_get_through_goes_into_the_next():
    source = RemoteSource(lambda: None)
    source.request_arrived()
    source.request_finished(0.2, None)
    first = source.take()
    source.request_arrived()
    source.give_back(first)
    again = source.take()
    assert (again["arrivals"], again["finished"]) == (2, [[0.2, None]])
    assert source.take()["arrivals"] == 0


def test_what_a_gateway_buffers_while_the_controller_is_away_is_bounded_and_always_accepted():
    from stoker.gateway.plane import MAX_BUFFERED, MAX_REPORTED

    source = RemoteSource(lambda: None)
    for i in range(MAX_BUFFERED + 5):
        source.request_finished(float(i), None)
    for i in range(MAX_REPORTED + 5):
        source.report_failure(f"i{i}")
    news = source.take()
    assert len(news["finished"]) == MAX_BUFFERED and news["finished"][-1] == [float(MAX_BUFFERED + 4), None]
    assert len(news["failures"]) == MAX_REPORTED and news["failures"][-1] == f"i{MAX_REPORTED + 4}"
    parse_report({"gateway": "g", "deployments": {"m@1": news}})  # not refused: it would be kept for ever
