"""The streaming proxy: one request to one instance, relayed to the client as it arrives.

Nothing is buffered between the upstream read and the client's `send`: each chunk from
`readany()` is sent, and the send awaited, before the next read, so a slow client slows the
instance down through TCP backpressure (the habit of uvicorn's flow control). The client gets the
response start only when the first body byte is in hand: until then nothing from this instance has
reached the client, and a failure can still be retried on another one.

aiohttp's errors and our own timeouts become `Failed` here; `Activator` turns that into a retry,
an `UpstreamError`, or an SSE error event.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

from activator.config import ActivatorConfig
from activator.source import Endpoint

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# An instance answering these is sick or overloaded, not the request: worth another instance.
RETRYABLE = frozenset({502, 503, 504})
# Hop-by-hop headers (RFC 9110 §7.6.1) and framing: the client-facing server re-frames the body.
# `date` and `server` are the front server's to set; forwarding them would duplicate them.
DROPPED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"date",
        b"server",
    }
)
ERROR_BODY_LIMIT = 64 * 1024  # an instance's error body, re-framed as one SSE event
DONE = b"data: [DONE]\n\n"  # the last event of an OpenAI stream


class Failed(Exception):
    """The instance failed before any of its bytes reached the client (one line: why)."""


class Missing(Failed):
    """The instance answered 404 for an adapter it was thought to hold: its engine evicted it."""


class Silence(asyncio.Timeout):
    """The deadline on an answer that is coming from an instance: none while the instance is in
    routing (aiohttp's `sock_read`, `chunk_gap_timeout_s`, bounds its gaps alone, and costs nothing
    per chunk); once it is ejected, `silence_s` from the ejection and then from each chunk.

    Why not end the answer at the ejection: an instance is also ejected for failing other requests
    (say, 503s from an engine whose own queue is full) while it streams the ones it took. Those
    finish; a stopped or wedged instance, which sends nothing, has its answers ended within
    seconds instead of minutes.
    """

    def __init__(self, silence_s: float) -> None:
        super().__init__(None)
        self.silence_s = silence_s

    def eject(self, now: float) -> None:
        if self.when() is None and not self.expired():
            self.reschedule(now + self.silence_s)

    def heard(self) -> None:
        """A chunk came: after an ejection, the next one may be `silence_s` away."""
        if self.when() is not None and not self.expired():
            self.reschedule(asyncio.get_running_loop().time() + self.silence_s)


def sse_event(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def error_event(message: str, type: str, code: str) -> bytes:
    """OpenAI's error object as an SSE event, then the end marker clients wait for."""
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return sse_event(body) + sse_event("[DONE]")


# What a held stream gets every `keepalive_interval_s`: a blank line pair, not an SSE comment.
# Both are nothing to a reader that follows the SSE spec (an empty event is not dispatched), and
# bytes enough for a proxy's idle timer. But vLLM's benchmark client strips each network read before
# it looks for the blank line that ends an event: a comment read alone (": waiting\n\n") loses its
# end there, and the data lines read after it join the comment and are skipped as one; a read that
# is only blank lines is dropped whole. So are readers that split on "\n\n" without stripping:
# "\n\n" keeps the stream on an event boundary, where a lone "\n" would prefix the first event. And
# go-openai, which fails a stream after 300 lines that are not data, counts two lines for either.
KEEPALIVE = b"\n\n"
PLAIN_KEEPALIVE = b" "  # JSON allows whitespace before a value: the parser skips it
# A scope key an in-process caller sets (the batch runner): no proxy stands between it and the
# activator, so a held plain request of its gets no whitespace keep-alive, and its status stays
# the answer's (a batch line refused while held must not land in the output file as a 200).
IN_PROCESS = "stoker.in_process"


class Reply:
    """What has gone to the client so far, and the only ways to add to it."""

    __slots__ = ("_send", "delivered", "sse", "started", "status")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False  # the response start (status and headers) went out
        self.sse = False  # ... and it announced an event stream
        self.status = 0
        # The whole answer went out: the instance's body to its end, or an event stream's
        # `data: [DONE]`. A client that leaves after that (the openai client closes at [DONE],
        # before the body's last frame) was answered, not lost.
        self.delivered = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started, self.status = True, status
        self.sse = any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in headers)
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, chunk: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": False})

    async def keepalive(self, cold: bool, stream: bool = True) -> None:
        """`KEEPALIVE` for a held stream, after a 200 event-stream start if none went out yet; for a
        held plain request, `PLAIN_KEEPALIVE` after a 200 JSON start (`plain_keepalive_interval_s`)."""
        if not self.started:
            await self.start(200, held_headers(cold) if stream else held_plain_headers(cold))
        await self.body(KEEPALIVE if stream else PLAIN_KEEPALIVE)


def held_headers(cold: bool) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),  # tells nginx-style proxies in front not to buffer
        (b"x-stoker-cold-start", b"true" if cold else b"false"),
    ]


def held_plain_headers(cold: bool) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", b"application/json"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        (b"x-stoker-cold-start", b"true" if cold else b"false"),
        (b"x-stoker-held", b"whitespace"),  # the status is 200 whatever follows: read the body
    ]


def error_body(message: str, type_: str, code: str | None) -> bytes:
    """OpenAI's error object, as the body of a held plain request whose 200 went out."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def relayed_headers(resp: aiohttp.ClientResponse, endpoint_id: str, cold: bool) -> list[tuple[bytes, bytes]]:
    named = {
        token.strip().lower().encode()
        for value in resp.headers.getall("connection", ())
        for token in value.split(",")
    }
    headers = [
        (name.lower(), value)
        for name, value in resp.raw_headers
        if name.lower() not in DROPPED and name.lower() not in named
    ]
    headers.append((b"x-stoker-instance", endpoint_id.encode()))
    headers.append((b"x-stoker-cold-start", b"true" if cold else b"false"))
    return headers


async def forward(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    path: str,
    body: bytes,
    content_type: bytes | None,
    reply: Reply,
    config: ActivatorConfig,
    *,
    last: bool,
    cold: bool,
    stream: bool,
    on_first_byte: Callable[[int], None],
    waits: set[asyncio.Timeout] | None = None,
    missing: bool = False,
) -> int:
    """POST `body` to `endpoint` and relay the answer through `reply`; the status to count.
    `missing`: a 404 raises `Missing` (an adapter the engine evicted) instead of being relayed.

    Raises `Failed` while nothing of this instance's answer reached the client: connection
    refused or reset, no headers in time (`headers_deadline_s`), a 502/503/504 (unless `last`:
    then it is passed through), or the body failing before its first byte. After that, a failure
    ends the response (an SSE error event for event streams) and counts as 502.

    While it waits for headers, the request's deadline is in `waits` (the activator's set for this
    instance): ejecting the instance moves those deadlines to now (`expire`), so a plain request,
    whose headers may take minutes, does not wait them out on an instance known to be sick. While
    the body comes, a `Silence` is in `waits` instead: an ejection leaves the answer at most
    `stream_headers_timeout_s` between chunks rather than `chunk_gap_timeout_s` (300 s), so a stream
    on a stopped instance ends with an error event within seconds, and a plain answer whose body
    had not begun is retried elsewhere.
    """
    # Relay bytes as they are, never decompress. The client's own headers (its API key among them)
    # are not forwarded; the instance gets its own key instead.
    headers = {**endpoint.auth_headers, "accept-encoding": "identity"}
    if content_type:
        headers["content-type"] = content_type.decode("latin-1")
    deadline_s = headers_deadline_s(config, stream)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(deadline_s) as wait:
            if waits is not None:
                waits.add(wait)
            try:
                resp = await session.post(
                    endpoint.url + path, data=body, headers=headers, timeout=_timeout(config)
                )
            finally:
                if waits is not None:
                    waits.discard(wait)
    except aiohttp.ClientError as exc:  # first: aiohttp's connect timeout is a TimeoutError too
        raise Failed(f"{endpoint.id}: {_describe(exc)}") from None
    except TimeoutError:
        if loop.time() - started < deadline_s:
            raise Failed(f"{endpoint.id} was ejected while the request waited for its headers") from None
        raise Failed(f"no response headers from {endpoint.id} within {deadline_s:g} s") from None
    except OSError as exc:
        raise Failed(f"{endpoint.id}: {_describe(exc)}") from None

    gap_s = config.chunk_gap_timeout_s
    silence = Silence(headers_deadline_s(config, stream=True))
    relaying = False  # some of this answer is on its way to the client: no retry from here on
    async with resp:
        try:
            async with silence:
                if waits is not None:
                    waits.add(silence)
                try:
                    if resp.status in RETRYABLE and not last:
                        raise Failed(f"{endpoint.id} answered {resp.status}")
                    if resp.status == 404 and missing:
                        raise Missing(f"{endpoint.id} does not hold the adapter")
                    first = await _read(resp, gap_s, endpoint.id)
                    relaying = True
                    on_first_byte(resp.status)
                    if not reply.started:
                        await reply.start(resp.status, relayed_headers(resp, endpoint.id, cold))
                    elif resp.status != 200 and reply.sse:  # a held stream: its 200 already went out
                        return await _status_into_stream(resp, first, reply, gap_s, endpoint.id, silence)
                    return await _relay(resp, first, reply, gap_s, endpoint.id, silence)
                finally:
                    if waits is not None:
                        waits.discard(silence)
        except TimeoutError:
            resp.close()
            if not silence.expired():
                raise
            reason = f"{endpoint.id} was ejected, then sent nothing for {silence.silence_s:g} s"
            if not relaying:
                raise Failed(reason) from None
            await reply.end(_failure_event(reason) if reply.sse else b"")
            return 502
        except BaseException:
            resp.close()  # drop the connection: the instance sees it and stops generating
            raise


async def _relay(
    resp: aiohttp.ClientResponse, first: bytes, reply: Reply, gap_s: float, endpoint_id: str, silence: Silence
) -> int:
    """Each chunk to the client as it arrives; a failure from here on ends the response."""
    chunk, seen = first, b""
    while chunk:
        await reply.body(chunk)
        if reply.sse:  # [DONE] may straddle two reads only when the last is shorter than it
            seen = (seen + chunk)[-len(DONE) :] if len(chunk) < len(DONE) else chunk
            reply.delivered = seen.endswith(DONE)
        try:
            chunk = await _read(resp, gap_s, endpoint_id)
            silence.heard()
        except Failed as exc:
            resp.close()
            await reply.end(_failure_event(str(exc)) if reply.sse else b"")
            return 502
    reply.delivered = True
    await reply.end()
    return resp.status


async def _status_into_stream(
    resp: aiohttp.ClientResponse, first: bytes, reply: Reply, gap_s: float, endpoint_id: str, silence: Silence
) -> int:
    """An error status for a stream whose 200 went out while it was held can no longer be a
    status: its body (OpenAI's error object, from an engine) travels as an SSE error event."""
    parts, size, chunk = [], 0, first
    try:
        while chunk and size < ERROR_BODY_LIMIT:
            parts.append(chunk)
            size += len(chunk)
            chunk = await _read(resp, gap_s, endpoint_id)
            silence.heard()
    except Failed:
        pass
    await reply.end(_status_event(resp.status, b"".join(parts)))
    return resp.status


def headers_deadline_s(config: ActivatorConfig, stream: bool) -> float:
    """How long to wait for an instance's response headers. A stream's come before its first token
    (both engines), so a short deadline catches a stopped or wedged instance; a plain request's
    come with the whole answer, so only the long `first_byte_timeout_s` may bound them."""
    if stream:
        return min(config.stream_headers_timeout_s, config.first_byte_timeout_s)
    return config.first_byte_timeout_s


def expire(waits: set[asyncio.Timeout]) -> None:
    """The instance was ejected: end every wait for headers in `waits` now (each raises `Failed` in
    its `forward`), and bound every answer it is sending by its `Silence`."""
    now = asyncio.get_running_loop().time()
    for wait in list(waits):
        if isinstance(wait, Silence):
            wait.eject(now)
        elif not wait.expired():
            wait.reschedule(now)


@functools.cache
def _timeout(config: ActivatorConfig) -> aiohttp.ClientTimeout:
    """aiohttp's own deadlines for a request: connect, and silence on the socket (`sock_read`).

    No total (long generations are normal). `sock_read` bounds the gap between chunks inside
    aiohttp's reader, which costs far less per chunk than an `asyncio.timeout` around each read
    (measured: 100-170 µs of CPU per 20-chunk stream); it also bounds the wait for headers, so
    that wait ends at the smaller of `first_byte_timeout_s` and `chunk_gap_timeout_s`.
    """
    return aiohttp.ClientTimeout(
        total=None, sock_connect=config.connect_timeout_s, sock_read=config.chunk_gap_timeout_s
    )


async def _read(resp: aiohttp.ClientResponse, gap_s: float, endpoint_id: str) -> bytes:
    """The next chunk as it arrives (b"" at the end), within `gap_s` of silence (aiohttp's sock_read)."""
    try:
        return await resp.content.readany()
    except aiohttp.ServerTimeoutError:
        raise Failed(f"{endpoint_id} sent nothing for {gap_s:g} s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise Failed(f"{endpoint_id}: {_describe(exc)}") from None


def _failure_event(reason: str) -> bytes:
    return error_event(f"The model instance failed mid-response: {reason}", "server_error", "upstream_failed")


def _status_event(status: int, body: bytes) -> bytes:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return sse_event(parsed) + sse_event("[DONE]")
    kind = "invalid_request_error" if status < 500 else "server_error"
    return error_event(f"The model instance answered {status}.", kind, f"upstream_{status}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "connection closed by the instance"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
