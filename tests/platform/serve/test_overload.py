"""Overload sheds, it does not stall: ten times what a deployment's `--max 1` can take, on a real
`stoker up` with the tiny model.

One instance takes `CAPACITY` requests at once (the CPU engine's slots, `--max-num-seqs`); the
activator holds `QUEUE` more (`--max-queued`) and refuses the rest at once. So of `OFFERED` =
10 × `CAPACITY` requests sent together, plain and streamed mixed:

| when | promise |
|---|---|
| at zero | exactly `QUEUE` held and answered by the cold start; the other `OFFERED - QUEUE` refused at once: 503, Retry-After, OpenAI's error object, code queue_full |
| warm | none lost, at least `CAPACITY + QUEUE` answered, the rest refused the same way |
| both | every refusal within the hold deadline (a flag) plus `SLACK`; nothing hangs (a request past its bound is counted lost) |
| a held stream | its 200 at once, keep-alives, then its tokens when a slot frees |
| a held client leaves | its place in the queue is free at once (the queue-length gauge drops, a 499 is counted) and the next request is held instead of refused |
| a served client leaves | its slot goes to the longest-held request |
| no slot frees within `--hold-deadline` (2 s, its own platform) | the held refused when it is up (503; a held stream, already 200, an SSE error event), the rest at once; none later than 2 s plus `SLACK` |
| bodies past `--max-body-memory` (8 MiB, its own platform) | one that does not fit refused unread (503 server_overloaded, Retry-After) while a small one is served; its bytes back once a holder leaves |
| afterwards | the queue empty and the deployment serving every request |

The first two tests share one platform (one engine start: the first finds it at zero); the other
two have their own, for their flags. How long the admitted requests took under overload, their p99
against a 1× baseline, the refusals' latency and the platform's memory at 10× and 30× are measured
by `bench/overload_bench.py`, never asserted here. Every wait polls the metrics with a deadline
from tests/deadlines.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.deadlines import ENGINE_START, WAIT, deadline, flag
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.platform.reliability_support import COMPLETE, REFUSED, Outcome, burst, describe, lost, tally
from warm_pool.pool_spec import PoolSpec

CAPACITY = PoolSpec.instance_concurrency  # requests one instance takes at once (8)
QUEUE = 2 * CAPACITY  # --max-queued
OFFERED = 10 * CAPACITY
HOLD_S = deadline(90)  # --hold-deadline: long enough for a cold start on a loaded machine
SLACK = deadline(10)  # what a refusal may take past the hold deadline (the gateway's own work)
REQUEST_S = HOLD_S + deadline(60)  # one request's bound: past it, it is a hang (counted lost)
LONG = 1900  # tokens of a request that keeps its slot while the test looks (the tiny model: 2048 positions)
FLAGS = ("--max-queued", str(QUEUE), "--hold-deadline", flag(90), "--keepalive-interval", "0.2")


@pytest.fixture(scope="module")
def overloaded(tmp_path_factory, tiny_model_dir):
    """One platform for the module (one engine start): the tiny model deployed at zero, `--max 1`.
    The first test finds it at zero; the second warms it up if need be."""
    p = PlatformProcess(tmp_path_factory.mktemp("overload") / "home", free_port(), FLAGS).start()
    try:
        r = httpx.post(
            f"{p.url}/admin/v1/deployments",
            json={"name": "tiny", "model": str(tiny_model_dir), "max": 1, "idle_timeout_s": 600},
            timeout=deadline(120),
        )
        assert r.status_code in (200, 201), r.text
        yield p
    finally:
        p.stop()


async def gauge(p: PlatformProcess, name: str, **labels: str) -> float:
    return await asyncio.to_thread(p.metric, name, deployment="tiny", **labels)


async def until(p: PlatformProcess, name: str, want: float, **labels: str) -> None:
    """Poll metric `name` until it reads `want`, within WAIT."""
    end = time.monotonic() + WAIT
    while (value := await gauge(p, name, **labels)) != want:
        if time.monotonic() > end:
            raise TimeoutError(f"{name}{labels} is {value:g}, not {want:g}, after {WAIT:g} s")
        await asyncio.sleep(0.05)


def check_refusals(outcomes: list[Outcome]) -> None:
    """Every refusal clean (the classifier: 503 or 429, a Retry-After, OpenAI's error object), a
    queue_full, and back no later than the hold deadline plus SLACK."""
    refused = [o for o in outcomes if o.kind == REFUSED]
    assert {o.reason for o in refused} <= {"503 queue_full"}, {o.reason for o in refused}
    late = [o.seconds for o in refused if o.seconds > HOLD_S + SLACK]
    assert not late, f"refusals after the hold deadline ({HOLD_S:g} s) + {SLACK:g} s: {late}"


class Stream:
    """One streamed request the test holds open: its status, what it has read so far, and a way to
    leave (close the connection) at any point."""

    def __init__(self, client: httpx.AsyncClient, url: str, i: int, max_tokens: int, **extra: str) -> None:
        body = {"model": "tiny", "prompt": f"long {i}", "max_tokens": max_tokens, "ignore_eos": True, **extra}
        self._cm = client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True})
        self.status = 0
        self.keepalives = 0  # blank lines before the first event
        self.events = 0

    async def open(self) -> Stream:
        self.response = await self._cm.__aenter__()
        self.status = self.response.status_code
        self._lines: AsyncIterator[str] = self.response.aiter_lines()
        return self

    async def next_event(self) -> str:
        """Read up to the next `data:` line, counting the keep-alives before the first."""
        async for line in self._lines:
            if line.startswith("data:"):
                self.events += 1
                return line[5:].strip()
            if not line and not self.events:
                self.keepalives += 1
        raise EOFError("the stream ended")

    async def leave(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._cm.__aexit__(None, None, None)


async def test_ten_times_capacity_is_shed_cleanly_at_zero_and_warm(overloaded):
    p = overloaded
    at_zero = await burst(p.url, OFFERED, bound_s=REQUEST_S)
    assert not lost(at_zero), describe(at_zero)
    # Nothing can be served before the cold start: exactly QUEUE held, all of them answered.
    assert (tally(at_zero)[COMPLETE], tally(at_zero)[REFUSED]) == (QUEUE, OFFERED - QUEUE)
    check_refusals(at_zero)
    # The refusals came at once, before the cold start answered anyone.
    assert max(o.ended for o in at_zero if o.kind == REFUSED) < min(
        o.ended for o in at_zero if o.kind == COMPLETE
    )
    assert {o.stream for o in at_zero if o.kind == COMPLETE} == {True, False}

    # Warm: long enough answers (64 tokens) that the instance is still full when the last arrive.
    warm = await burst(p.url, OFFERED, max_tokens=64, bound_s=REQUEST_S, first=OFFERED)
    assert not lost(warm), describe(warm)
    # Any refusal means the queue was full, and everything held is answered: at least this many.
    assert tally(warm)[COMPLETE] >= CAPACITY + QUEUE
    check_refusals(warm)

    await until(p, "stoker_queue_length", 0)
    after = await burst(p.url, CAPACITY, bound_s=REQUEST_S, first=2 * OFFERED)
    assert tally(after)[COMPLETE] == CAPACITY, describe(after)
    assert p.metric("stoker_instance_starts_total", deployment="tiny", outcome="ready") == 1


async def test_a_client_leaving_frees_its_place_and_its_slot(overloaded):
    """The instance full with long streams and the queue full behind them (held streams, and one
    plain request last): a held stream gets keep-alives; one more request is refused; the plain
    request's client leaves, then a held stream's: each time the queue is one shorter at once, a 499
    is counted, and the next request is held in the place, not refused; a served client leaves and
    the longest-held request takes its slot."""
    p = overloaded
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_S), limits=limits) as client:
        warmup = await burst(p.url, 1, bound_s=REQUEST_S)  # READY (started here, or already)
        assert tally(warmup)[COMPLETE] == 1, describe(warmup)
        served = [await Stream(client, p.url, i, LONG).open() for i in range(CAPACITY)]
        for s in served:  # each has its slot: a token came
            assert s.status == 200 and (await s.next_event()).startswith("{")
        held = [await Stream(client, p.url, CAPACITY + i, LONG).open() for i in range(QUEUE - 1)]
        body = {"model": "tiny", "prompt": "plain", "max_tokens": 4}
        plain = asyncio.ensure_future(client.post(f"{p.url}/v1/completions", json=body))
        await until(p, "stoker_queue_length", QUEUE)
        assert all(s.status == 200 for s in held)  # held streams: a 200 and keep-alives at once

        refused = await burst(p.url, 1, bound_s=REQUEST_S, first=100)
        assert [o.reason for o in refused] == ["503 queue_full"], describe(refused)

        gone = await gauge(p, "stoker_requests_total", code="499")
        plain.cancel()  # a held plain request's client leaves: nothing was sent to it yet
        with contextlib.suppress(asyncio.CancelledError):
            await plain
        await until(p, "stoker_queue_length", QUEUE - 1)
        await until(p, "stoker_requests_total", gone + 1, code="499")
        newcomer = await Stream(client, p.url, 200, 4).open()  # held in the freed place
        await until(p, "stoker_queue_length", QUEUE)
        assert newcomer.status == 200

        await held[-1].leave()  # a held stream's client leaves, after its keep-alives began
        await until(p, "stoker_queue_length", QUEUE - 1)
        await until(p, "stoker_requests_total", gone + 2, code="499")

        await served[0].leave()  # its slot goes to the longest-held request: held[0]
        await until(p, "stoker_queue_length", QUEUE - 2)
        first = await held[0].next_event()
        assert first.startswith("{") and held[0].keepalives >= 1, (first, held[0].keepalives)
        await until(p, "stoker_requests_total", gone + 3, code="499")

        for s in [*served[1:], *held[:-1], newcomer]:
            await s.leave()
    await until(p, "stoker_queue_length", 0)
    after = await burst(p.url, CAPACITY, bound_s=REQUEST_S, first=300)
    assert tally(after)[COMPLETE] == CAPACITY, describe(after)


async def test_held_requests_are_refused_at_the_hold_deadline_when_no_slot_frees(
    platform_factory, tiny_model_dir
):
    """`--hold-deadline 2s` (and its cap, so that no measured start lengthens it) with every slot
    taken by long streams for longer than that: of OFFERED - CAPACITY more requests, QUEUE are held
    and refused when their 2 s are up (a plain one with 503, a held stream, already 200, with an
    SSE error event after its keep-alives), the rest at once; none later than 2 s plus SLACK, none
    lost. Then the instance serves again."""
    p = platform_factory(
        "--max-queued", str(QUEUE), "--hold-deadline", "2s", "--hold-deadline-max", "2s",
        "--keepalive-interval", "0.2",
    )  # fmt: skip
    body = {"name": "tiny", "model": str(tiny_model_dir), "min_warm": 1, "max": 1, "idle_timeout_s": 600}
    async with httpx.AsyncClient(timeout=deadline(120)) as c:
        r = await c.post(f"{p.url}/admin/v1/deployments", json=body)
    assert r.status_code in (200, 201), r.text
    ready = lambda: p.deployments()["tiny"]["instances"]["READY"] == 1  # noqa: E731
    await asyncio.to_thread(p.wait_for, ready, ENGINE_START, "READY")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_S), limits=limits) as client:
        served = [await Stream(client, p.url, i, LONG).open() for i in range(CAPACITY)]
        for s in served:
            assert s.status == 200 and (await s.next_event()).startswith("{")
        shed = await burst(p.url, OFFERED - CAPACITY, bound_s=REQUEST_S)
        for s in served:
            await s.leave()
    assert not lost(shed), describe(shed)
    assert tally(shed)[REFUSED] == OFFERED - CAPACITY
    reasons = Counter(o.reason for o in shed)
    assert reasons["503 queue_full"] == OFFERED - CAPACITY - QUEUE, reasons
    assert reasons["503 hold_deadline"] + reasons["error event hold_deadline"] == QUEUE, reasons
    assert reasons["error event hold_deadline"] > 0 and reasons["503 hold_deadline"] > 0, reasons
    late = [o.seconds for o in shed if o.seconds > 2 + SLACK]
    assert not late, f"refusals later than the 2 s hold deadline + {SLACK:g} s: {late}"

    await until(p, "stoker_queue_length", 0)
    after = await burst(p.url, CAPACITY, bound_s=REQUEST_S, first=OFFERED)
    assert tally(after)[COMPLETE] == CAPACITY, describe(after)


async def test_request_bodies_held_at_once_are_bounded(platform_factory, tiny_model_dir):
    """`--max-body-memory 8MiB`: two streams with 3 MiB bodies (an accepted `user` field) in flight;
    a third such body is refused at once, unread (503 server_overloaded, Retry-After, OpenAI's
    error object), while a small request is served; once one of the two streams leaves, its 3 MiB
    are back and the big body is served. Without the bound, a gateway read every body offered at
    once: 200 clients sending 1 MiB each took `stoker up` from 82 to 505 MiB."""
    p = platform_factory("--max-body-memory", "8MiB", *FLAGS)
    body = {"name": "tiny", "model": str(tiny_model_dir), "min_warm": 1, "max": 1, "idle_timeout_s": 600}
    async with httpx.AsyncClient(timeout=deadline(120)) as c:
        r = await c.post(f"{p.url}/admin/v1/deployments", json=body)
    assert r.status_code in (200, 201), r.text
    ready = lambda: p.deployments()["tiny"]["instances"]["READY"] == 1  # noqa: E731
    await asyncio.to_thread(p.wait_for, ready, ENGINE_START, "READY")
    big = "u" * (3 << 20)
    plain_big = {"model": "tiny", "prompt": "big", "max_tokens": 2, "user": big}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_S), limits=limits) as client:
        streams = []
        for i in range(2):
            s = Stream(client, p.url, i, LONG, user=big)
            streams.append(await s.open())
            assert s.status == 200 and (await s.next_event()).startswith("{")

        r = await client.post(f"{p.url}/v1/completions", json=plain_big)
        assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "server_overloaded"
        small = await burst(p.url, 1, bound_s=REQUEST_S)
        assert tally(small)[COMPLETE] == 1, describe(small)

        await streams[0].leave()
        # Its body is freed once the gateway sees the client gone (its next write or read fails),
        # not at the moment the client closed: until then a big body is still refused.
        end = asyncio.get_running_loop().time() + deadline(30)
        while True:
            r = await client.post(f"{p.url}/v1/completions", json=plain_big)
            if r.status_code != 503 or asyncio.get_running_loop().time() > end:
                break
            assert r.json()["error"]["code"] == "server_overloaded", r.text
            await asyncio.sleep(0.05)
        assert r.status_code == 200, r.text
        await streams[1].leave()
