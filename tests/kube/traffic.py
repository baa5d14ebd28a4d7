"""What the end-to-end tests on the fake cluster put in front of and through the processes: a
Service (connections to whichever controller replica listens, as a Service's endpoints are its
ready pods) and a steady load of chat requests that keeps every answer."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import httpx

from tests.deadlines import deadline


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


class Load:
    """Chat requests to `model` through each of `urls` in turn, one after another, until stopped:
    every answer kept as (status, revision, instance, the start of its body)."""

    def __init__(self, urls: list[str], headers: dict[str, str], model: str = "chat") -> None:
        self.urls, self.headers, self.model = urls, headers, model
        self.answers: list[tuple[int, str | None, str | None, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(headers=self.headers, timeout=deadline(120)) as http:
            i = 0
            while not self._stop.is_set():
                r = http.post(f"{self.urls[i % len(self.urls)]}/v1/chat/completions", json=body)
                self.answers.append(
                    (
                        r.status_code,
                        r.headers.get("x-stoker-revision"),
                        r.headers.get("x-stoker-instance"),
                        r.text[:200],
                    )
                )
                i += 1

    def failed(self) -> list[tuple]:
        return [a for a in self.answers if a[0] != 200]

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
