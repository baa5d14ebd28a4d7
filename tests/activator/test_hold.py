"""Holding: a request with no instance free waits (bounded, with a deadline), pokes the pool at once,
and is served in order when capacity appears; a held stream is kept alive with blank lines."""

from __future__ import annotations

import asyncio
import json
import time

from openai._streaming import SSEDecoder

from activator.proxy import KEEPALIVE
from tests.activator.conftest import COMPLETION, Ep, MemorySource, Rig, eventually

PLAIN = {"model": "m", "prompt": "hi"}
STREAM = {"model": "m", "prompt": "hi", "stream": True}


async def test_request_at_zero_is_held_then_served_as_a_cold_start(rig: Rig) -> None:
    now = [100.0]
    source = MemorySource()
    activator = rig.activator(source, clock=lambda: now[0])
    rig.a.before_headers = asyncio.Event()
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))

    await eventually(lambda: activator.load().queued == 1)
    assert source.pokes == 1  # at once, on arrival
    assert activator.load().last_arrival == 100.0 and activator.load().in_flight == 0
    assert rig.sample("stoker_queue_length") == 1
    now[0] = 107.0  # the instance is READY 7 s later
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    await eventually(lambda: len(rig.a.requests) == 1)
    assert activator.load().outstanding == {"a": 1}
    now[0] = 107.5  # its first byte, half a second later
    rig.a.before_headers.set()
    response = await call

    assert response.status_code == 200 and response.json() == COMPLETION
    assert response.headers["x-stoker-cold-start"] == "true"
    assert response.headers["x-stoker-instance"] == "a"
    assert response.headers["x-upstream"] == "yes"
    # The activator finishes its books just after the last byte went out.
    await eventually(lambda: rig.sample("stoker_requests_total", code="200") == 1)
    assert activator.load().outstanding == {}
    assert rig.sample("stoker_queue_wait_seconds_sum") == 7.0
    assert rig.sample("stoker_request_ttft_seconds_sum") == 7.5
    assert rig.sample("stoker_cold_start_first_byte_seconds_sum") == 0.5
    assert rig.sample("stoker_request_duration_seconds_sum") == 7.5
    assert rig.sample("stoker_queue_length") == 0

    warm = await rig.client.post("/v1/completions", json=PLAIN)
    assert warm.headers["x-stoker-cold-start"] == "false"
    assert source.pokes == 1  # an instance was ready: nothing to ask of the pool
    await eventually(lambda: rig.sample("stoker_requests_total", code="200") == 2)
    assert rig.sample("stoker_cold_start_first_byte_seconds_count") == 1


async def test_queue_full_is_refused_at_once(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, max_queued=1, hold_deadline_s=30)
    held = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)

    started = time.monotonic()
    refused = await rig.client.post("/v1/completions", json=PLAIN)
    assert time.monotonic() - started < 1.0
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "queue_full"
    assert rig.sample("stoker_requests_total", code="503") == 1

    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    assert (await held).status_code == 200


async def test_a_zero_queue_refuses_but_still_pokes_the_pool(rig: Rig) -> None:
    source = MemorySource()
    rig.activator(source, max_queued=0, retry_after_s=7)
    refused = await rig.client.post("/v1/completions", json=PLAIN)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "7"
    assert source.pokes == 1


async def test_held_past_the_deadline_is_refused(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, hold_deadline_s=0.2)
    started = time.monotonic()
    response = await rig.client.post("/v1/completions", json=PLAIN)
    assert 0.2 <= time.monotonic() - started < 2.0
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "hold_deadline"
    assert activator.load().queued == 0 and rig.sample("stoker_queue_length") == 0
    assert rig.sample("stoker_queue_wait_seconds_count") == 1
    assert rig.sample("stoker_request_duration_seconds_count") == 0  # the gateway answered it


async def test_a_start_expected_to_be_long_holds_its_requests_longer(rig: Rig) -> None:
    # A fixed deadline refused the requests of a vLLM start that took 180 s of a 120 s hold.
    now = [0.0]
    source = MemorySource(expected=100.0)  # the tier's measured start: 100 s
    activator = rig.activator(source, hold_deadline_s=0.2, clock=lambda: now[0])
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    now[0] = 120.0  # past the fixed 0.2 s, within 1.5 x 100 s
    # Five times the fixed deadline, in real time: a hold with the fixed one would have looked at
    # its deadline again (0.2 s away when it began) and refused by now.
    await asyncio.sleep(1.0)
    assert activator.load().queued == 1
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    response = await call
    assert response.status_code == 200 and response.headers["x-stoker-cold-start"] == "true"


def test_the_hold_follows_the_expected_start_within_its_bounds(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, hold_deadline_s=120, hold_deadline_max_s=600)
    for expected, held in (
        (None, 120),
        (10.0, 120),
        (100.0, 150),
        (300.0, 450),
        (1000.0, 600),
        (float("nan"), 120),
    ):
        source.expected = expected
        assert activator._hold_for() == held, expected


async def test_a_held_plain_request_kept_alive_with_whitespace_parses_as_its_answer(rig: Rig) -> None:
    # Through a proxy that cuts connections idle for its timeout, a plain request held at zero got
    # no byte until its answer, and was cut; a held stream survived on its keep-alives.
    source = MemorySource()
    activator = rig.activator(source, plain_keepalive_interval_s=0.05, hold_deadline_s=30)
    async with rig.client.stream("POST", "/v1/completions", json=PLAIN) as response:
        assert response.status_code == 200  # at once, before any instance exists
        assert response.headers["x-stoker-held"] == "whitespace"
        assert response.headers["content-type"] == "application/json"
        chunks = response.aiter_raw()
        first = await anext(chunks)
        assert first.startswith(b" ") and first.strip(b" ") == b""  # a space, then more of them
        await eventually(lambda: activator.load().queued == 1)
        source.eps.append(Ep("a", rig.a_url))
        activator.capacity_changed()
        body = first + b"".join([chunk async for chunk in chunks])
    assert body.startswith(b" ") and json.loads(body) == COMPLETION  # JSON skips the leading spaces


async def test_a_failure_after_the_whitespace_is_openais_error_in_the_body(rig: Rig) -> None:
    source = MemorySource()
    rig.activator(source, plain_keepalive_interval_s=0.05, hold_deadline_s=0.3)
    response = await rig.client.post("/v1/completions", json=PLAIN)
    assert response.status_code == 200 and response.headers["x-stoker-held"] == "whitespace"
    error = json.loads(response.content)["error"]
    assert error["code"] == "hold_deadline" and error["type"] and error["message"]
    await eventually(lambda: rig.sample("stoker_requests_total", code="503") == 1)  # counted as what it was


async def test_without_plain_keepalive_a_held_request_gets_its_own_status(rig: Rig) -> None:
    source = MemorySource()
    rig.activator(source, hold_deadline_s=0.2)  # the default: off
    response = await rig.client.post("/v1/completions", json=PLAIN)
    assert response.status_code == 503 and "x-stoker-held" not in response.headers


async def test_held_stream_gets_keepalives_then_the_answer(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, keepalive_interval_s=0.05)
    async with rig.client.stream("POST", "/v1/completions", json=STREAM) as response:
        # The 200 cannot wait for the instance: it goes out with the first keep-alive.
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-stoker-cold-start"] == "true"
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        reads = []
        chunks = response.aiter_raw()
        while b"".join(reads).count(KEEPALIVE) < 2:
            reads.append(await anext(chunks))
        assert activator.load().queued == 1
        held_reads = list(reads)
        source.eps.append(Ep("a", rig.a_url))
        activator.capacity_changed()
        async for chunk in chunks:
            reads.append(chunk)
    received = b"".join(reads)
    events = [e for e in received.decode().split("\n\n") if e.startswith("data: ")]
    assert len(events) == 21 and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["text"] == "t0 "
    # The keep-alives are blank lines on event boundaries: nothing to an SSE reader, nothing left
    # of them in a read that is stripped (vLLM's benchmark client), and no prefix on the first event
    # for a reader that splits on blank lines.
    held = received[: received.index(b"data: ")]
    assert held == KEEPALIVE * (len(held) // len(KEEPALIVE)) and len(held) >= 2 * len(KEEPALIVE)
    assert all(not r.strip() for r in held_reads)
    assert next(e for e in received.split(b"\n\n") if e).startswith(b"data: ")
    assert len(list(SSEDecoder().iter_bytes(iter(reads)))) == 21  # the openai client's own reader
    await eventually(lambda: rig.sample("stoker_requests_total", code="200") == 1)


async def test_with_keepalives_off_a_held_stream_waits_for_its_answers_status(rig: Rig) -> None:
    """`keepalive_interval_s=None`: nothing goes out while a stream is held, so its answer's own
    status reaches the client (a 400 stays a 400, not an SSE error event after a 200)."""
    source = MemorySource()
    activator = rig.activator(source, keepalive_interval_s=None, hold_deadline_s=30)
    rig.a.status = 400
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=STREAM))
    await eventually(lambda: activator.load().queued == 1)
    await asyncio.sleep(0.05)  # what would have been several keep-alives at the interval below
    assert not call.done()  # no headers yet: they would have come with the first keep-alive
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    response = await call
    assert response.status_code == 400 and response.json()["error"]["code"] == "c"
    await eventually(lambda: rig.sample("stoker_requests_total", code="400") == 1)


async def test_held_stream_past_its_deadline_ends_with_an_error_event(rig: Rig) -> None:
    source = MemorySource()
    rig.activator(source, keepalive_interval_s=0.05, hold_deadline_s=0.2)
    response = await rig.client.post("/v1/completions", json=STREAM)
    assert response.status_code == 200  # headers went out with the keep-alives
    assert response.text.startswith("\n\n")  # keep-alives went out
    events = response.text.split("\n\n")
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "hold_deadline"
    assert error["param"] is None and error["message"]
    assert events[-2:] == ["data: [DONE]", ""]
    await eventually(lambda: rig.sample("stoker_requests_total", code="503") == 1)


async def test_client_that_leaves_while_held_leaves_the_queue(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, hold_deadline_s=30)
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    call.cancel()  # httpx drops the connection
    await eventually(lambda: activator.load().queued == 0)
    assert rig.sample("stoker_queue_length") == 0
    await eventually(lambda: rig.sample("stoker_requests_total", code="499") == 1)
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    assert activator.load().outstanding == {} and rig.a.requests == []


async def test_held_stream_answered_with_an_error_status_gets_it_as_an_event(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, keepalive_interval_s=0.05)
    rig.a.status = 400
    async with rig.client.stream("POST", "/v1/completions", json=STREAM) as response:
        chunks = response.aiter_raw()
        received = await anext(chunks)
        assert received == KEEPALIVE
        source.eps.append(Ep("a", rig.a_url))
        activator.capacity_changed()
        async for chunk in chunks:
            received += chunk
    events = received.decode().split("\n\n")
    error = json.loads(events[-3].removeprefix("data: "))
    assert error == {"error": {"message": "nope", "type": "x", "param": None, "code": "c"}}
    assert events[-2:] == ["data: [DONE]", ""]
    await eventually(lambda: rig.sample("stoker_requests_total", code="400") == 1)


async def test_a_full_queue_is_shared_between_keys_and_they_take_turns(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, max_queued=3, hold_deadline_s=30)

    def post(owner: str, n: int):
        body = {**PLAIN, "prompt": f"{owner}{n}"}
        return asyncio.ensure_future(
            rig.client.post("/v1/completions", json=body, headers={"x-owner": owner})
        )

    flood = []
    for n in range(3):  # one key fills the queue ...
        flood.append(post("a", n))
        await eventually(lambda n=n: activator.load().queued == n + 1)
    refused = await post("a", 3)  # ... and its own next request is refused, as always
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
    mine = post("b", 0)  # another key still gets a place: a's newest gives it up
    displaced = await flood[2]
    assert displaced.status_code == 503 and displaced.json()["error"]["code"] == "queue_full"
    assert displaced.headers["retry-after"] == "2"
    await eventually(lambda: activator.load().queued == 3)

    source.eps.append(Ep("a", rig.a_url, max_concurrency=1))  # one slot: the order is visible
    activator.capacity_changed()
    done = await asyncio.gather(flood[0], flood[1], mine)
    assert [r.status_code for r in done] == [200, 200, 200]
    # b's request went second, between a's two, though it came after both.
    assert [r["prompt"] for r in rig.a.requests] == ["a0", "b0", "a1"]


def post_as(rig: Rig, owner: str, n: int, priority: int, body: dict = PLAIN):
    """A request of key `owner` at `priority` (what the gateway settled), its prompt naming it."""
    headers = {"x-owner": owner, "x-priority": str(priority)}
    body = {**body, "prompt": f"{owner}{n}"}
    return asyncio.ensure_future(rig.client.post("/v1/completions", json=body, headers=headers))


async def test_an_interactive_request_held_behind_bulk_ones_is_served_first(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, hold_deadline_s=30)
    activator.set_engine_priority(True)  # as Stoker's engine: each body says its request's priority
    bulk = []
    for n in range(3):  # a batch key's requests, held at zero instances ...
        bulk.append(post_as(rig, "batch", n, 10))
        await eventually(lambda n=n: activator.load().queued == n + 1)
    urgent = post_as(rig, "app", 0, -1)  # ... then an interactive key's, after all of them
    await eventually(lambda: activator.load().queued == 4)

    source.eps.append(Ep("a", rig.a_url, max_concurrency=1))  # one slot: the order is visible
    activator.capacity_changed()
    done = await asyncio.gather(urgent, *bulk)
    assert [r.status_code for r in done] == [200] * 4
    assert [r["prompt"] for r in rig.a.requests] == ["app0", "batch0", "batch1", "batch2"]
    assert [r.get("priority") for r in rig.a.requests] == [-1, 10, 10, 10]  # the key's, added


async def test_a_full_queue_of_bulk_requests_makes_room_for_an_interactive_one(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, max_queued=2, hold_deadline_s=30)
    # as vLLM under fcfs: the engine takes no priority, so none goes upstream
    bulk = [post_as(rig, "batch", 0, 10, {**PLAIN, "priority": 10})]
    await eventually(lambda: activator.load().queued == 1)
    bulk.append(post_as(rig, "batch", 1, 10, {**PLAIN, "priority": 10}))
    await eventually(lambda: activator.load().queued == 2)
    refused = await post_as(rig, "batch", 2, 10)  # its own next one: refused, as always
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
    urgent = post_as(rig, "app", 0, 0)  # served before them: the newest bulk request gives way
    displaced = await bulk[1]
    assert displaced.status_code == 503 and displaced.json()["error"]["code"] == "queue_full"
    await eventually(lambda: activator.load().queued == 2)

    source.eps.append(Ep("a", rig.a_url, max_concurrency=1))
    activator.capacity_changed()
    assert [r.status_code for r in await asyncio.gather(urgent, bulk[0])] == [200, 200]
    assert [r["prompt"] for r in rig.a.requests] == ["app0", "batch0"]
    assert all("priority" not in r for r in rig.a.requests)


async def test_held_requests_are_counted_by_priority_band(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, hold_deadline_s=30)
    held = [post_as(rig, "app", 0, -3), post_as(rig, "batch", 0, 50), post_as(rig, "batch", 1, 50)]
    await eventually(lambda: activator.load().queued == 3)
    bands = {b: rig.sample("stoker_queue_length_by_priority", band=b) for b in ("high", "default", "low")}
    assert bands == {"high": 1, "default": 0, "low": 2}
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 3
    assert rig.sample("stoker_queue_length_by_priority", band="low") == 0
