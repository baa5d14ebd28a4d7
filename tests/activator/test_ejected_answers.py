"""Answers already coming from an instance when it is ejected: at most `stream_headers_timeout_s`
of silence from then on, not `chunk_gap_timeout_s` (300 s). Found by the reliability suite (a
stream on a SIGSTOPped engine hung for minutes after the engine was ejected)."""

from __future__ import annotations

import asyncio
import json

from activator import proxy
from tests.activator.conftest import Ep, MemorySource, Rig, eventually, read_all, running

STREAM = {"model": "m", "prompt": "hi", "stream": True}
PLAIN = {"model": "m", "prompt": "hi"}


def events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def test_a_stream_mid_answer_on_an_instance_ejected_and_silent_ends_with_an_error_event(
    rig: Rig,
) -> None:
    source = MemorySource([Ep("a", rig.a_url)])
    activator = rig.activator(source, eject_after=1, health_timeout_s=0.1, stream_headers_timeout_s=0.2)
    stopped = rig.a.gate = asyncio.Event()  # a sends one chunk, then nothing: stopped
    async with asyncio.timeout(3), rig.client.stream("POST", "/v1/completions", json=STREAM) as r:
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        rig.a.before_headers = stopped  # its /health goes unanswered too
        await activator.check_health()
        assert activator.ejected() == ["a"]
        rest = "\n".join([line async for line in lines])
    data = events(rest)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["code"] == "upstream_failed" and "sent nothing for 0.2 s" in error["message"]
    await eventually(rig.a.disconnected.is_set)  # the upstream connection was dropped
    stopped.set()


async def test_an_ejected_instance_still_sending_finishes_its_stream(rig: Rig) -> None:
    # Ejected for failing probes (or other requests), yet this stream's chunks keep coming, each
    # well within the 0.2 s bound: it is not cut.
    source = MemorySource([Ep("a", rig.a_url)])
    activator = rig.activator(source, eject_after=1, health_timeout_s=0.1, stream_headers_timeout_s=0.2)
    rig.a.gate = asyncio.Event()
    rig.a.chunk_delay_s = 0.05
    async with asyncio.timeout(5), rig.client.stream("POST", "/v1/completions", json=STREAM) as r:
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        silent = rig.a.before_headers = asyncio.Event()
        await activator.check_health()
        assert activator.ejected() == ["a"]
        rig.a.gate.set()
        rest = "\n".join([line async for line in lines])
    data = events(rest)
    assert data[-1] == "[DONE]" and not any('"error"' in d for d in data)
    assert len(data) == 20  # 19 more chunks and the end marker
    silent.set()


def awaiting_body(activator) -> bool:
    """A request on this activator has its headers and waits for its body (its `Silence` is
    registered where an ejection finds it)."""
    return any(isinstance(w, proxy.Silence) for waits in activator._routing._waits.values() for w in waits)


class HeadersThenSilence:
    """An instance stopped between writing a plain answer's headers and its body."""

    def __init__(self) -> None:
        self.health = asyncio.Event()  # set: /health answers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await self.health.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await read_all(receive)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await asyncio.Event().wait()  # the body never comes


async def test_a_plain_answer_whose_body_had_not_begun_is_retried_elsewhere(rig: Rig) -> None:
    stalled = HeadersThenSilence()
    async with running(stalled) as (url,):
        source = MemorySource([Ep("s", url)])
        activator = rig.activator(source, eject_after=1, health_timeout_s=0.1, stream_headers_timeout_s=0.2)
        plain = asyncio.ensure_future(rig.client.post("/v1/completions", json=PLAIN))
        await eventually(lambda: awaiting_body(activator))  # past its headers: it waits for the body
        source.eps.append(Ep("b", rig.b_url))
        await activator.check_health()
        assert activator.ejected() == ["s"]
        async with asyncio.timeout(3):
            answer = await plain
        assert answer.status_code == 200 and answer.headers["x-stoker-instance"] == "b"
        assert answer.json()["choices"][0]["text"] == "Paris"
        stalled.health.set()
