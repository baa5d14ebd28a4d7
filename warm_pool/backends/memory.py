"""An in-memory backend: engines that start at once and live until stopped or killed, and the engine
calls on them (sleep, wake, capabilities, their word on their sleep), all without processes or HTTP.
The pool's tests run the real `Pool` on it on a fake clock (`tests/warm_pool/rig.py`): it records
every call, and a start, a sleep or a wake can be made to fail, and an engine to die, on cue."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from warm_pool.backends.base import Placement, Running
from warm_pool.backends.procs import ProcessHandle
from warm_pool.engine_calls import EngineCapabilities
from warm_pool.errors import PoolError
from warm_pool.launch import LaunchSpec
from warm_pool.reconcile import Observed
from warm_pool.snapshot import Acquired, SnapshotSource


@dataclass
class MemoryBackend:
    """Engines that start at once and live until stopped or killed; sleep and wake succeed unless
    told to fail. It is also the pool's engine calls (`Pool(engines=...)`)."""

    kind = "memory"
    engine_tls = None  # its engines take no connections
    alive: set[ProcessHandle] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (action, url)
    fail: set[str] = field(default_factory=set)  # "sleep", "wake"
    sleep_levels: tuple[int, ...] = (1, 2)  # what its engines say they can do
    keys: set[str] = field(default_factory=set)  # the Authorization each engine call carried
    specs: list[LaunchSpec] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    urls: dict[ProcessHandle, str] = field(default_factory=dict)
    pids: itertools.count = field(default_factory=lambda: itertools.count(1000))
    ports: itertools.count = field(default_factory=lambda: itertools.count(20000))
    observed: dict[str, Observed] = field(default_factory=dict)  # url → what its engine says of its sleep

    def engine_port(self, host: str) -> int:
        return next(self.ports)

    async def acquire(self, snapshot: SnapshotSource, holder: str) -> Acquired:
        return await snapshot.acquire(holder=holder)

    async def start(self, placement: Placement, spec: LaunchSpec) -> ProcessHandle:
        self.specs.append(spec)
        self.placements.append(placement)
        pid = next(self.pids)
        handle = ProcessHandle(pid, pid, 1, placement.instance_id)
        self.alive.add(handle)
        self.urls[handle] = f"http://{placement.host}:{placement.port}"
        return handle

    def is_alive(self, handle: ProcessHandle) -> bool:
        return handle in self.alive

    async def wait_ready(self, handle: ProcessHandle, timeout_s: float, *, health_path: str) -> str:
        return self.urls[handle]

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None:
        self.alive.discard(handle)
        return 0

    async def running(self) -> list[Running]:
        return []

    async def read_log(self, instance_id: str, max_bytes: int) -> str | None:
        return None

    async def device_capacity(self) -> tuple[int, str] | None:
        return None

    def held_up(self, handle) -> str | None:
        return None

    async def aclose(self) -> None:
        return None

    async def read_startup_phases(
        self, url: str, instance_id: str | None = None, headers=None
    ) -> dict[str, float]:
        return {}

    async def read_capabilities(self, url: str, headers=None) -> EngineCapabilities:
        self.keys.add((headers or {}).get("authorization", ""))
        return EngineCapabilities(self.sleep_levels)

    async def observe_sleep(self, url: str, headers=None) -> Observed:
        return self.observed.get(url, Observed.AWAKE)

    async def sleep(self, url: str, level: int, timeout_s: float, headers=None) -> None:
        self.keys.add((headers or {}).get("authorization", ""))
        await self._call("sleep", url)

    async def wake_up(self, url: str, timeout_s: float, headers=None) -> None:
        self.keys.add((headers or {}).get("authorization", ""))
        await self._call("wake", url)

    async def _call(self, action: str, url: str) -> None:
        self.calls.append((action, url))
        await asyncio.sleep(0)
        if action in self.fail:
            raise PoolError(f"POST {url}: answered 500")
