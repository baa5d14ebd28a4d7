"""Forwarding: least-outstanding choice under per-instance limits, chunks relayed as they arrive,
disconnects that reach the instance, one retry before the first byte, errors after it as events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from tests.activator.conftest import CHUNKS, COMPLETION, Ep, MemorySource, Rig, closed_port, eventually

PLAIN = {"model": "m", "prompt": "hi"}
STREAM = {"model": "m", "prompt": "hi", "stream": True}


async def open_stream(client: httpx.AsyncClient) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
    """Start a streaming request; return the response, its raw chunks, and the first chunk."""
    response = await client.send(client.build_request("POST", "/v1/completions", json=STREAM), stream=True)
    chunks = response.aiter_raw()
    return response, chunks, await anext(chunks)


def data_events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.startswith("data: ")]


async def test_least_outstanding_within_each_instance_limit(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url, max_concurrency=1), Ep("b", rig.b_url, max_concurrency=2)])
    activator = rig.activator(source)
    gate = rig.a.gate = rig.b.gate = asyncio.Event()
    streams = [await open_stream(rig.client) for _ in range(3)]
    assert sorted(r.headers["x-stoker-instance"] for r, _, _ in streams) == ["a", "b", "b"]
    assert activator.outstanding("a") == 1 and activator.outstanding("b") == 2

    held = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))  # both are full
    await eventually(lambda: activator.load().queued == 1)
    load = activator.load()
    assert (load.in_flight, load.queued, dict(load.outstanding)) == (3, 1, {"a": 1, "b": 2})
    assert source.pokes == 1  # full, so the pool hears of it, but nothing was cold
    gate.set()  # the streams finish; a freed slot wakes the held request
    for response, chunks, _ in streams:
        async for _ in chunks:
            pass
        await response.aclose()
    answer = await held
    assert answer.status_code == 200 and answer.headers["x-stoker-cold-start"] == "false"


async def test_chunks_are_relayed_as_they_arrive(rig: Rig) -> None:
    rig.activator(MemorySource([Ep("a", rig.a_url)]))
    rig.a.gate = asyncio.Event()
    response, chunks, first = await open_stream(rig.client)
    # The client holds chunk 1 while the instance is still waiting to send chunk 2.
    assert data_events(first) == ['{"choices": [{"index": 0, "text": "t0 "}]}']
    assert rig.a.sent == 1
    assert response.headers["x-stoker-instance"] == "a"
    assert response.headers["x-stoker-cold-start"] == "false"
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert "content-length" not in response.headers
    rig.a.gate.set()
    rest = b"".join([chunk async for chunk in chunks])
    await response.aclose()
    events = data_events(first + rest)
    assert len(events) == CHUNKS + 1 and events[-1] == "[DONE]"
    # The body and its content type reached the instance as sent; nothing asked it to compress.
    assert rig.a.requests == [STREAM]
    assert rig.a.headers[0][b"content-type"] == b"application/json"
    assert rig.a.headers[0][b"accept-encoding"] == b"identity"


async def test_client_disconnect_cancels_the_upstream_request(rig: Rig) -> None:
    activator = rig.activator(MemorySource([Ep("a", rig.a_url)]))
    rig.a.gate = asyncio.Event()
    response, _, _ = await open_stream(rig.client)
    await response.aclose()  # leaves mid-stream
    await asyncio.wait_for(rig.a.disconnected.wait(), 2)  # the instance saw its connection drop
    await eventually(lambda: rig.sample("stoker_requests_total", code="499") == 1)
    assert activator.outstanding("a") == 0
    assert rig.a.sent == 1


async def test_a_client_that_leaves_right_after_done_was_answered_not_lost(rig: Rig) -> None:
    """The openai client closes its connection at `data: [DONE]`, before the body's last frame: the
    activator may hear it leave while the relay still waits for the instance's end. Held here
    between the two, that client left after its whole answer: a 200, not a 499."""
    activator = rig.activator(MemorySource([Ep("a", rig.a_url)]))
    rig.a.after_done = asyncio.Event()
    response, chunks, received = await open_stream(rig.client)
    while not received.endswith(b"data: [DONE]\n\n"):
        received += await anext(chunks)
    await response.aclose()
    await eventually(lambda: rig.sample("stoker_requests_total", code="200") == 1)
    assert rig.sample("stoker_requests_total", code="499") is None
    assert len(data_events(received)) == CHUNKS + 1 and activator.outstanding("a") == 0
    assert rig.sample("stoker_request_duration_seconds_count") == 1
    rig.a.after_done.set()


async def test_refused_connection_is_retried_on_another_instance(rig: Rig) -> None:
    dead = Ep("dead", f"http://127.0.0.1:{closed_port()}")
    source = MemorySource([dead])
    activator = rig.activator(source)
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    # The only instance failed: the retry is held (and the pool poked) until another is ready.
    await eventually(lambda: activator.load().queued == 1)
    assert source.failures == ["dead"] and source.pokes == 1
    source.eps.append(Ep("b", rig.b_url))
    activator.capacity_changed()
    response = await call
    assert response.status_code == 200 and response.json() == COMPLETION
    assert response.headers["x-stoker-instance"] == "b"
    assert source.failures == ["dead"]


async def test_retry_never_goes_back_to_the_instance_that_failed(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url), Ep("b", rig.b_url)])
    rig.activator(source)
    rig.a.status = 503  # sick: answers every request with 503
    responses = [await rig.client.post("/v1/completions", json=PLAIN) for _ in range(4)]
    assert [r.status_code for r in responses] == [200] * 4
    assert {r.headers["x-stoker-instance"] for r in responses} == {"b"}
    assert len(rig.a.requests) >= 1 and source.failures == ["a"] * len(rig.a.requests)


async def test_three_refusals_are_an_upstream_error(rig: Rig) -> None:
    """A request no instance answered at all is held for another after each, up to three (two
    failing at once, one killed and one stopped, must not end it: their replacement answers)."""
    source = MemorySource([Ep("x", f"http://127.0.0.1:{closed_port()}")])
    activator = rig.activator(source)
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    for name in ("y", "z"):
        await eventually(lambda: activator.load().queued == 1)
        source.eps.append(Ep(name, f"http://127.0.0.1:{closed_port()}"))
        activator.capacity_changed()
    response = await call
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed" and "cannot connect" in error["message"]
    assert source.failures == ["x", "y", "z"]
    assert rig.sample("stoker_requests_total", code="502") == 1


async def test_second_error_status_is_passed_through(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url), Ep("b", rig.b_url)])
    rig.activator(source)
    rig.a.status = rig.b.status = 503
    response = await rig.client.post("/v1/completions", json=PLAIN)
    assert response.status_code == 503 and response.json()["error"]["message"] == "nope"
    assert response.headers["x-upstream"] == "yes"
    assert sorted(source.failures) == ["a", "b"]


async def test_client_errors_pass_through_unretried(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url), Ep("b", rig.b_url)])
    rig.activator(source)
    rig.a.status = rig.b.status = 400
    response = await rig.client.post("/v1/completions", json=PLAIN)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "nope", "type": "x", "param": None, "code": "c"}}
    assert response.headers["x-upstream"] == "yes"
    assert len(rig.a.requests) + len(rig.b.requests) == 1 and source.failures == []
    await eventually(lambda: rig.sample("stoker_requests_total", code="400") == 1)
    assert rig.sample("stoker_request_ttft_seconds_count") == 0  # an error is not a first token


async def test_no_headers_in_time_is_retried_elsewhere(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url)])
    activator = rig.activator(source, first_byte_timeout_s=0.1)
    rig.a.before_headers = asyncio.Event()  # a never answers
    call = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    assert source.failures == ["a"]
    source.eps.append(Ep("b", rig.b_url))
    activator.capacity_changed()
    assert (await call).headers["x-stoker-instance"] == "b"
    rig.a.before_headers.set()


async def test_failure_after_the_first_byte_ends_the_stream_with_an_error_event(rig: Rig) -> None:
    source = MemorySource([Ep("a", rig.a_url), Ep("b", rig.b_url)])
    rig.activator(source)
    rig.a.die_after_first = rig.b.die_after_first = True
    response = await rig.client.post("/v1/completions", json=STREAM)
    assert response.status_code == 200
    events = data_events(response.content)
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "t0 "
    error = json.loads(events[1])["error"]
    assert error["code"] == "upstream_failed" and error["type"] == "server_error"
    assert len(rig.a.requests) + len(rig.b.requests) == 1  # too late to retry
    await eventually(lambda: rig.sample("stoker_requests_total", code="502") == 1)


async def test_a_silent_instance_mid_stream_ends_it_with_an_error_event(rig: Rig) -> None:
    rig.activator(MemorySource([Ep("a", rig.a_url)]), chunk_gap_timeout_s=0.1)
    rig.a.gate = asyncio.Event()  # never set: silence after the first chunk
    response = await rig.client.post("/v1/completions", json=STREAM)
    events = data_events(response.content)
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert "sent nothing for 0.1 s" in json.loads(events[1])["error"]["message"]
    await asyncio.wait_for(rig.a.disconnected.wait(), 2)  # and the instance was let go


async def test_failure_mid_json_ends_the_body_short(rig: Rig) -> None:
    rig.activator(MemorySource([Ep("a", rig.a_url)]))
    rig.a.die_after_first = True
    response = await rig.client.post("/v1/completions", json=PLAIN)
    assert response.status_code == 200  # the status went out with the first byte
    assert json.dumps(COMPLETION).startswith(response.text) and len(response.text) == 20
    await eventually(lambda: rig.sample("stoker_requests_total", code="502") == 1)
