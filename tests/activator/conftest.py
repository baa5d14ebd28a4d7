"""Fixtures for the activator: tiny upstream engines, a minimal front app, an in-memory source.

Everything that crosses HTTP crosses real loopback sockets: uvicorn serves the upstreams and the
front app inside the test's event loop, aiohttp (through the activator) and httpx are the clients.
Nothing here buffers a stream, so a test can see a chunk arrive before the next one is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from activator import Activator, ActivatorConfig, ActivatorError, ActivatorMetrics
from stoker.errors import error_response
from stoker.gateway.endpoint import api_error
from tests.deadlines import deadline

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "m",
    "choices": [{"index": 0, "text": "Paris", "finish_reason": "stop"}],
}
CHUNKS = 20


@dataclass(frozen=True)
class Ep:
    id: str
    url: str
    max_concurrency: int = 8
    auth_headers: dict = field(default_factory=dict)


@dataclass
class MemorySource:
    """The activator's view of a pool, in memory: a list of endpoints, and the pokes, failures,
    arrivals and ends (seconds held, instance it was cold on) it was told of."""

    eps: list[Ep] = field(default_factory=list)
    pokes: int = 0
    failures: list[str] = field(default_factory=list)
    arrivals: int = 0
    finished: list[tuple[float | None, str | None]] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    expected: float | None = None  # seconds the start a held request waits on is expected to take

    def endpoints(self) -> list[Ep]:
        return self.eps

    def expected_start_s(self) -> float | None:
        return self.expected

    def poke(self) -> None:
        self.pokes += 1

    def report_failure(self, endpoint_id: str) -> None:
        self.failures.append(endpoint_id)

    def report_unhealthy(self, endpoint_id: str, reason: str) -> None:
        self.unhealthy.append(endpoint_id)

    def request_arrived(self) -> None:
        self.arrivals += 1

    def request_finished(self, service_s: float | None, cold_on: str | None) -> None:
        self.finished.append((service_s, cold_on))


class Upstream:
    """An engine stand-in: a completion as JSON, or `CHUNKS` SSE chunks when the body says stream.

    Switches: `before_headers`, when set, holds every answer until the test sets it; `status` answers that status with an OpenAI error body; `gate`, when set, holds a
    stream after its first chunk until the test sets it; `after_done`, when set, holds a stream
    after its `data: [DONE]` event, before the body's end, until the test sets it; `die_after_first`
    drops the connection after the first chunk (or, for JSON, after the first half of the body).
    `disconnected` is set when a client leaves a stream midway.
    """

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict[bytes, bytes]] = []
        self.status = 200
        self.health = 200  # what GET /health answers
        self.gate: asyncio.Event | None = None
        self.before_headers: asyncio.Event | None = None
        self.after_done: asyncio.Event | None = None
        self.die_after_first = False
        self.chunk_delay_s = 0.001
        self.disconnected = asyncio.Event()
        self.sent = 0  # stream chunks sent, over all requests

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # /health: `health` is its status; `before_headers` holds it too
            if self.before_headers is not None:
                await self.before_headers.wait()
            await send({"type": "http.response.start", "status": self.health, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        request = json.loads(await read_all(receive))
        self.requests.append(request)
        self.headers.append(dict(scope["headers"]))
        if self.before_headers is not None:
            await self.before_headers.wait()
        if self.status != 200:
            error = {"error": {"message": "nope", "type": "x", "param": None, "code": "c"}}
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status,
                    "headers": [(b"content-type", b"application/json"), (b"x-upstream", b"yes")],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps(error).encode()})
            return
        if not request.get("stream"):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"x-upstream", b"yes")],
                }
            )
            whole = json.dumps(COMPLETION).encode()
            if self.die_after_first:
                await send({"type": "http.response.body", "body": whole[:20], "more_body": True})
                raise ConnectionAbortedError("upstream dies on purpose")
            await send({"type": "http.response.body", "body": whole})
            return
        await self._stream(receive, send)

    async def _stream(self, receive, send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
                }
            )
            for i in range(CHUNKS):
                if self.disconnected.is_set():
                    return
                data = {"choices": [{"index": 0, "text": f"t{i} "}]}
                await send({"type": "http.response.body", "body": sse(data), "more_body": True})
                self.sent += 1
                if i == 0 and self.die_after_first:
                    raise ConnectionAbortedError("upstream dies on purpose")
                if i == 0 and self.gate is not None:
                    await first_of(self.gate.wait(), self.disconnected.wait())
                else:
                    await asyncio.sleep(self.chunk_delay_s)
        finally:
            watcher.cancel()
        if self.after_done is not None:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
            await self.after_done.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def first_of(*aws) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def read_all(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


class Front:
    """The smallest gateway: read the body, call the activator, answer its errors with the real
    gateway's table (`stoker.gateway.endpoint.api_error`), so these tests see what clients will."""

    def __init__(self) -> None:
        self.activator: Activator | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = await read_all(receive)
        try:
            headers = dict(scope["headers"])
            owner = headers.get(b"x-owner", b"").decode()  # the gateway's key id
            priority = int(headers.get(b"x-priority", b"0"))  # the priority the gateway settled
            stream = bool(json.loads(body).get("stream"))
            await self.activator.serve(scope, receive, send, body, stream, owner, priority=priority)
        except ActivatorError as exc:
            await error_response(api_error(exc))(scope, receive, send)


class QuietServer(uvicorn.Server):
    def capture_signals(self):  # several servers in one test process: leave signals alone
        return contextlib.nullcontext()


def closed_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def running(*apps) -> AsyncIterator[list[str]]:
    """Serve each app on its own free loopback port; yield their base URLs; stop them together."""
    socks, servers, tasks = [], [], []
    for app in apps:
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
        # and with proto 0 every small write after the first waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, lifespan="off", log_level="critical", access_log=False, log_config=None)
        socks.append(sock)
        servers.append(QuietServer(config))
        tasks.append(asyncio.ensure_future(servers[-1].serve(sockets=[sock])))
    try:
        await eventually(lambda: all(server.started for server in servers))
        yield [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in socks]
    finally:
        for server in servers:
            server.should_exit = server.force_exit = True
        await asyncio.gather(*tasks)
        for sock in socks:
            sock.close()


@dataclass
class Rig:
    """Two upstreams (a, b), a front app and an httpx client aimed at it."""

    a: Upstream
    b: Upstream
    a_url: str
    b_url: str
    front: Front
    client: httpx.AsyncClient
    session: aiohttp.ClientSession
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def activator(
        self, source: MemorySource, clock: Callable[[], float] | None = None, **config
    ) -> Activator:
        metrics = ActivatorMetrics(self.registry)
        kwargs = {"clock": clock} if clock else {}
        activator = Activator("d", source, ActivatorConfig(**config), self.session, metrics, **kwargs)
        self.front.activator = activator
        return activator

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"deployment": "d", **labels})


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    a, b, front = Upstream(), Upstream(), Front()
    async with running(a, b, front) as (a_url, b_url, front_url), aiohttp.ClientSession() as session:
        async with httpx.AsyncClient(base_url=front_url, timeout=deadline(5)) as client:
            yield Rig(a, b, a_url, b_url, front, client, session)


async def eventually(condition: Callable[[], bool], timeout_s: float = deadline(2)) -> None:
    """Wait until `condition()` holds (it is about another task's progress, not about time)."""
    async with asyncio.timeout(timeout_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.002)
