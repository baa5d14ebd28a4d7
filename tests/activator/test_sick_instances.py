"""Sick instances leave routing: a stream's short headers deadline, ejection after failures in a
row, waits for headers ended by an ejection, probes that re-admit, a 503 /health reported."""

from __future__ import annotations

import asyncio

from tests.activator.conftest import Ep, MemorySource, Rig, eventually

PLAIN = {"model": "m", "prompt": "hi"}
STREAM = {"model": "m", "prompt": "hi", "stream": True}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_streams_to_a_silent_instance_go_elsewhere_and_it_is_ejected(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url), Ep("b", rig.b_url)])
    activator = rig.activator(source, stream_headers_timeout_s=0.2, eject_after=2)
    rig.a.before_headers = asyncio.Event()  # a is stopped: it takes connections, answers nothing
    for _ in range(8):
        async with asyncio.timeout(2):  # each within one headers deadline and a retry
            response = await rig.client.post("/v1/completions", json=STREAM)
        assert response.status_code == 200 and response.headers["x-stoker-instance"] == "b"
    assert activator.ejected() == ["a"]
    assert len(rig.a.requests) == 2 and source.failures == ["a", "a"]  # then no more
    rig.a.before_headers.set()


async def test_an_ejection_ends_the_plain_requests_waiting_on_that_instance(rig: Rig) -> None:
    # A plain request's headers come with its whole answer, so no short deadline guards them; an
    # ejection does: the request that waits on the ejected instance is retried on another one.
    source = MemorySource([Ep("a", rig.a_url)])
    activator = rig.activator(source, eject_after=1, health_timeout_s=0.1)
    stopped = rig.a.before_headers = asyncio.Event()
    plain = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: len(rig.a.requests) == 1)
    source.eps.append(Ep("b", rig.b_url))
    await activator.check_health()  # a's /health is silent too
    assert activator.ejected() == ["a"]
    async with asyncio.timeout(2):
        answer = await plain
    assert answer.status_code == 200 and answer.headers["x-stoker-instance"] == "b"
    stopped.set()


async def test_probes_eject_a_stopped_instance_and_readmit_it_once_it_answers(rig: Rig) -> None:
    clock = Clock()
    source = MemorySource([Ep("a", rig.a_url), Ep("b", rig.b_url)])
    activator = rig.activator(source, clock, eject_after=2, eject_base_s=10, health_timeout_s=0.1)
    stopped = rig.a.before_headers = asyncio.Event()
    await activator.check_health()
    assert activator.ejected() == []  # one failure: not yet
    await activator.check_health()
    assert activator.ejected() == ["a"]
    for _ in range(4):
        assert (await rig.client.post("/v1/completions", json=PLAIN)).headers["x-stoker-instance"] == "b"
    stopped.set()  # SIGCONT
    clock.now += 9.9
    await activator.check_health()
    assert activator.ejected() == ["a"]  # not probed before its time is up
    clock.now += 0.1
    await activator.check_health()
    assert activator.ejected() == []
    served = {
        (await rig.client.post("/v1/completions", json=PLAIN)).headers["x-stoker-instance"] for _ in range(4)
    }
    assert served == {"a", "b"}
    assert source.unhealthy == []


async def test_a_503_health_is_reported_for_replacement_and_counts_as_a_failure(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url), Ep("b", rig.b_url)])
    activator = rig.activator(source, eject_after=1)
    rig.a.health = 503
    await activator.check_health()
    assert source.unhealthy == ["a"] and activator.ejected() == ["a"]


async def test_a_request_that_succeeds_clears_the_count(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url)])
    activator = rig.activator(source, eject_after=2, health_timeout_s=0.1)
    stopped = rig.a.before_headers = asyncio.Event()
    await activator.check_health()  # one failure
    stopped.set()
    assert (await rig.client.post("/v1/completions", json=PLAIN)).status_code == 200
    rig.a.before_headers = asyncio.Event()
    await activator.check_health()  # one again, not two in a row
    assert activator.ejected() == []
    rig.a.before_headers.set()


async def test_an_instance_ejected_again_and_again_is_reported_for_replacement(rig: Rig) -> None:
    clock = Clock()
    source = MemorySource([Ep("a", rig.a_url)])
    activator = rig.activator(
        source, clock, eject_after=1, eject_base_s=10, replace_after_ejections=2, health_timeout_s=0.1
    )
    stopped = rig.a.before_headers = asyncio.Event()  # stopped for good: every probe is silent
    await activator.check_health()
    assert activator.ejected() == ["a"] and source.unhealthy == []
    assert rig.sample("stoker_instances_ejected") == 1 and rig.sample("stoker_instance_ejections_total") == 1
    clock.now += 10
    await activator.check_health()  # its time is up, the probe fails: ejected a second time
    assert source.unhealthy == ["a"]  # the pool replaces it (its only instance: requests were held)
    assert rig.sample("stoker_instance_ejections_total") == 2
    source.eps.clear()  # replaced: it leaves the routing set, and the activator forgets it
    await activator.check_health()
    assert activator.ejected() == [] and rig.sample("stoker_instances_ejected") == 0
    stopped.set()


async def test_a_request_held_while_every_instance_is_ejected_is_not_a_cold_start(rig: Rig) -> None:
    """Cold means served by an instance that became READY after the request arrived: the one that
    was ejected and comes back after a probe was READY all along."""
    clock = Clock()
    source = MemorySource([Ep("a", rig.a_url)])
    activator = rig.activator(source, clock, eject_after=1, eject_base_s=10, health_timeout_s=0.1)
    rig.a.health = 500
    await activator.check_health()
    assert activator.ejected() == ["a"]
    held = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    rig.a.health, clock.now = 200, clock.now + 10
    await activator.check_health()  # re-admitted: the held request goes to it
    response = await held
    assert response.headers["x-stoker-instance"] == "a"
    assert response.headers["x-stoker-cold-start"] == "false"
    await eventually(lambda: len(source.finished) == 1)
    assert source.finished[0][1] is None
