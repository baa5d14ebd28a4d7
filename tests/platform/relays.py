"""TCP relays on loopback that a test controls, each in a thread of its own with its own event
loop, so that a test's blocking calls (a process start, a sync HTTP client) never stall them:
`IdleRelay` (a load balancer's idle timeout, tests/platform/serve/test_idle_proxy.py) and
`CutRelay` (a network partition, tests/platform/serve/test_plane_faults.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tests.platform.engine.conftest import free_port


async def pipe(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, heard: asyncio.Event | None = None
) -> None:
    """Bytes from `src` to `dst` until either side ends; `heard` is set on each chunk."""
    with contextlib.suppress(ConnectionError, OSError):
        while data := await src.read(65536):
            if heard is not None:
                heard.set()
            dst.write(data)
            await dst.drain()
    dst.close()


class Relay:
    """127.0.0.1:port → 127.0.0.1:upstream; subclasses say what a connection does (`_client`)."""

    def __init__(self, upstream_port: int = 0) -> None:
        self.upstream = upstream_port
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, upstream_port: int | None = None) -> str:
        """Listening; its URL."""
        if upstream_port is not None:
            self.upstream = upstream_port
        self._thread.start()
        self._ready.wait()
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, fn, *args) -> None:
        """`fn(*args)` on the relay's loop."""
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class IdleRelay(Relay):
    """Cuts a connection silent for `idle_s` in both directions, as a load balancer does."""

    def __init__(self, upstream_port: int, idle_s: float) -> None:
        super().__init__(upstream_port)
        self.idle_s = idle_s
        self.cut = 0

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        heard = asyncio.Event()
        pipes = [
            asyncio.ensure_future(pipe(reader, up_writer, heard)),
            asyncio.ensure_future(pipe(up_reader, writer, heard)),
        ]
        while not all(p.done() for p in pipes):
            heard.clear()
            try:
                await asyncio.wait_for(heard.wait(), self.idle_s)
            except TimeoutError:
                self.cut += 1
                break
        for p in pipes:
            p.cancel()
        for w in (writer, up_writer):
            w.close()


class CutRelay(Relay):
    """Cut, it closes every connection and black-holes new ones (accepted, nothing forwarded: a
    partition, not a refusal); healed, it closes those and forwards again."""

    def __init__(self, upstream_port: int = 0) -> None:
        super().__init__(upstream_port)
        self._cut = False
        self._open: set[asyncio.StreamWriter] = set()

    def cut(self) -> None:
        self.call(self._set, True)

    def heal(self) -> None:
        self.call(self._set, False)

    def _set(self, cut: bool) -> None:
        self._cut = cut
        for w in list(self._open):
            w.close()
        self._open.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        if self._cut:  # held open, silent, until healed
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return
        self._open.add(up_writer)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
