"""What the end-to-end tests on the fake cluster put in front of the processes: a Service
(connections to whichever controller replica listens, as a Service's endpoints are its ready pods).
The load through them is the reliability suite's (`tests.platform.reliability_support.Load`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def service(ports: list[int]) -> AsyncIterator[str]:
    """A Service on loopback, in this event loop: each connection goes to the first of `ports`
    that accepts it (a standby controller does not listen until it leads: it is not ready). Not
    modelled: kube-proxy's random choice among several ready endpoints (only one is ever ready)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def connect(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        for port in ports:
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))
            return
        client_w.close()  # no endpoint: refused, as a Service with no ready pod

    server = await asyncio.start_server(connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"
