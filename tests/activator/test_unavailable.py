"""A source that cannot start an instance says why: held requests are refused with its reason at
once, and new ones are not held, instead of each waiting out the hold deadline."""

from __future__ import annotations

import asyncio
import json
import time

from activator.proxy import KEEPALIVE
from tests.activator.conftest import Ep, MemorySource, Rig, eventually

PLAIN = {"model": "m", "prompt": "hi"}
STREAM = {"model": "m", "prompt": "hi", "stream": True}
REASON = "snapshot 0123abcd is corrupt: model.safetensors: size 100 bytes, expected 200"


async def test_held_requests_get_the_reason_at_once_and_new_ones_are_not_held(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, hold_deadline_s=60)
    started = time.monotonic()
    held = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    activator.set_unavailable(REASON)
    response = await held
    assert time.monotonic() - started < 5  # not the 60 s deadline
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    error = response.json()["error"]
    assert error["code"] == "deployment_unavailable" and REASON in error["message"]

    again = await rig.client.post("/v1/completions", json=PLAIN)
    assert again.status_code == 503 and again.json()["error"]["code"] == "deployment_unavailable"
    assert activator.load().queued == 0 and rig.sample("stoker_queue_length") == 0
    await eventually(lambda: rig.sample("stoker_requests_total", code="503") == 2)

    activator.set_unavailable(None)  # deployed again: requests are held (and served) as before
    served = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
    await eventually(lambda: activator.load().queued == 1)
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    assert (await served).status_code == 200


async def test_a_held_stream_ends_with_the_reason_as_an_error_event(rig: Rig) -> None:
    source = MemorySource()
    activator = rig.activator(source, keepalive_interval_s=0.05, hold_deadline_s=60)
    async with rig.client.stream("POST", "/v1/completions", json=STREAM) as response:
        assert response.status_code == 200
        received = b""
        chunks = response.aiter_raw()
        while KEEPALIVE not in received:
            received += await anext(chunks)
        activator.set_unavailable(REASON)
        async for chunk in chunks:
            received += chunk
    events = received.decode().split("\n\n")
    error = json.loads(next(e for e in events if e.startswith("data: {")).removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "deployment_unavailable"
    assert REASON in error["message"]
