"""What the activator tells its source about each request: its arrival, and its end with the seconds
it held an instance and, for a cold start, the instance that served it. Exactly once each."""

from __future__ import annotations

import asyncio

from tests.activator.conftest import Ep, MemorySource, Rig, eventually

PLAIN = {"model": "m", "prompt": "hi"}
STREAM = {"model": "m", "prompt": "hi", "stream": True}


async def test_a_request_served_at_once_reports_the_seconds_it_held_the_instance(rig: Rig) -> None:
    now = [50.0]
    source = MemorySource([Ep("a", rig.a_url)])
    rig.activator(source, clock=lambda: now[0])
    rig.a.before_headers = asyncio.Event()
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: len(rig.a.requests) == 1)
    assert source.arrivals == 1 and source.finished == []
    now[0] = 52.5  # the instance answers 2.5 s later
    rig.a.before_headers.set()
    response = await call
    assert response.headers["x-stoker-cold-start"] == "false"
    await eventually(lambda: len(source.finished) == 1)
    assert source.finished == [(2.5, None)]


async def test_a_request_held_at_zero_is_a_cold_start_on_the_instance_that_came_up(rig: Rig) -> None:
    now = [10.0]
    source = MemorySource()
    activator = rig.activator(source, clock=lambda: now[0])
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    now[0] = 17.0  # READY 7 s later: the wait is not service time
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    response = await call
    assert response.headers["x-stoker-cold-start"] == "true"
    await eventually(lambda: len(source.finished) == 1)
    assert source.arrivals == 1 and source.finished == [(0.0, "a")]


async def test_held_behind_a_busy_instance_cold_only_if_a_new_one_serves_it(rig: Rig) -> None:
    """The simulator's definition: cold means served by an instance that became READY after the
    request arrived, not merely held."""
    source = MemorySource([Ep("a", rig.a_url, max_concurrency=1)])
    activator = rig.activator(source)
    rig.a.before_headers = asyncio.Event()
    busy = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: len(rig.a.requests) == 1)

    held_new = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    source.eps.append(Ep("b", rig.b_url))  # a new instance takes it: a cold start
    activator.capacity_changed()
    response = await held_new
    assert response.headers["x-stoker-instance"] == "b"
    assert response.headers["x-stoker-cold-start"] == "true"

    source.eps.remove(source.eps[1])
    held_old = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    rig.a.before_headers.set()  # `a` frees up and serves it: it was there all along
    assert (await busy).status_code == 200
    response = await held_old
    assert response.headers["x-stoker-instance"] == "a"
    assert response.headers["x-stoker-cold-start"] == "false"
    await eventually(lambda: len(source.finished) == 3)
    assert source.arrivals == 3
    assert sorted(cold or "-" for _, cold in source.finished) == ["-", "-", "b"]
    assert all(held is not None and held >= 0 for held, _ in source.finished)


async def test_refused_expired_and_abandoned_requests_end_without_service(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, max_queued=1, hold_deadline_s=0.3)
    expired = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    refused = await rig.client.post("/v1/completions", json=PLAIN)
    assert refused.json()["error"]["code"] == "queue_full"
    assert (await expired).json()["error"]["code"] == "hold_deadline"

    left = asyncio.ensure_future(rig.client.post("/v1/completions", json=STREAM))
    await eventually(lambda: activator.load().queued == 1)
    left.cancel()  # the client leaves while held
    await eventually(lambda: len(source.finished) == 3)
    assert source.arrivals == 3
    assert source.finished == [(None, None)] * 3
