"""A stopping server does not cut a request still arriving (`stoker.http.make_server`): uvicorn's own
stop closed every connection with no request under way, also one it had accepted a moment before
whose request it had not read yet, and its client saw the connection reset with no answer."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from stoker.http import make_server
from tests.deadlines import deadline
from tests.platform.engine.conftest import free_port


async def hello(request):
    return PlainTextResponse("hello")


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def until(check) -> None:
    while True:
        done = check()
        if asyncio.iscoroutine(done):
            done = await done
        if done:
            return
        await asyncio.sleep(0.01)


async def test_a_request_arriving_on_a_connection_accepted_before_the_stop_is_answered():
    port = free_port()
    app = Starlette(routes=[Route("/", hello)])
    server = make_server(app, host="127.0.0.1", port=port, log_level="warning", grace_period_s=10)
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(deadline(30)):
            await until(lambda: server.started)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # accepted, nothing sent
            await until(lambda: server.server_state.connections)
            server.should_exit = True
            await until(lambda: refused(port))  # the stop has begun: it accepts no new connection
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await writer.drain()
            answer = await reader.read()
            writer.close()
            await serving
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, deadline(10))
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello")
