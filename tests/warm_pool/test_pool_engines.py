"""The pool and its engines' capabilities and figures, on a fake clock: an engine without sleep mode
is never put to sleep, and the READY engines' own /metrics, read over real HTTP on loopback, reach
the decision. The real `Pool`, policy and scraper; the in-memory `Backend` and `Demand` of
test_pool_sleep, whose engines here also serve /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from aiohttp import web

from tests.activator.conftest import eventually
from tests.deadlines import deadline
from tests.warm_pool.rig import Rig, pool_rig
from warm_pool.backends.base import Placement
from warm_pool.backends.local import free_port
from warm_pool.backends.memory import MemoryBackend
from warm_pool.backends.procs import ProcessHandle
from warm_pool.engine_calls import EngineCapabilities
from warm_pool.launch import LaunchSpec
from warm_pool.policies.base import Decision, ScalingConfig

IDLE = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\n"
FULL = "vllm:num_requests_waiting 3\nvllm:num_requests_running 8\nvllm:kv_cache_usage_perc 0.97\n"


@dataclass
class NoSleepBackend(MemoryBackend):
    """Engines that report no sleep levels, as vLLM's CPU build does."""

    async def read_capabilities(self, url: str, headers=None) -> EngineCapabilities:
        return EngineCapabilities(sleep_levels=())


@dataclass
class MetricsBackend(MemoryBackend):
    """Engines that also serve `/metrics` on the port the pool gave them: a real HTTP server each."""

    exposition: str = IDLE
    hits: dict[int, int] = field(default_factory=dict)  # port → scrapes
    servers: dict[ProcessHandle, web.AppRunner] = field(default_factory=dict)

    def engine_port(self, host: str) -> int:
        # A free port, not the memory backend's fixed 20000, 20001 ...: every other pool test's
        # scraper reads its own instances' /metrics there, and on a shared loopback it would be
        # counted here as this test's scrapes.
        return free_port()

    async def start(self, placement: Placement, spec: LaunchSpec) -> ProcessHandle:
        handle = await super().start(placement, spec)
        port = placement.port

        async def metrics(_: web.Request) -> web.Response:
            self.hits[port] = self.hits.get(port, 0) + 1
            return web.Response(text=self.exposition)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.servers[handle] = runner
        return handle

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None:
        if (runner := self.servers.pop(handle, None)) is not None:
            await runner.cleanup()
        return await super().stop(handle, term_timeout_s)


def running_pool(tmp_path: Path, model_dir: Path, backend: MemoryBackend, scaling: ScalingConfig):
    return pool_rig(tmp_path, model_dir, backend, scaling=scaling)


async def decided(rig: Rig, at: float, condition: Callable[[Decision], bool]) -> Decision:
    """Tick at `at` until the decision meets `condition` (a scrape runs in the background: its
    figures show at a later tick)."""
    async with asyncio.timeout(deadline(5)):
        while True:
            await rig.tick(at)
            if condition(rig.pool.last_decision):
                return rig.pool.last_decision
            await asyncio.sleep(0.01)


async def test_without_sleep_mode_an_idle_instance_is_stopped_and_never_put_to_sleep(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    scaling = ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1)
    async with running_pool(tmp_path, tiny_model_dir, NoSleepBackend(), scaling) as rig:
        # what the launch learns from the engine; said here before any launch
        rig.pool.lifecycle.can_sleep = False
        first = await rig.serve_one(0.0)
        await rig.tick(5.0)  # with sleep mode this instance would go to sleep here (test_pool_sleep)
        assert (rig.pool.last_decision.ready, rig.pool.last_decision.sleeping) == (0, 0)
        await eventually(lambda: not any(rig.pool.counts().values()))
        assert rig.backend.calls == [] and not rig.backend.alive
        assert await rig.serve_one(20.0) != first  # a fresh start, not a wake
        assert [action for action, _ in rig.backend.calls] == []


async def test_the_pool_itself_never_sleeps_an_engine_without_sleep_mode(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    scaling = ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1)
    async with running_pool(tmp_path, tiny_model_dir, NoSleepBackend(), scaling) as rig:
        rig.pool.lifecycle.can_sleep = False
        await rig.serve_one(0.0)
        # A policy that skips the shared rules and asks for a sleep anyway (none of ours does):
        # the pool's own guard drains and stops the instance instead.
        asks_sleep = replace(rig.pool._bound, decide=lambda o, state, now: (Decision(0, 1), state))
        rig.pool._bound = asks_sleep
        await rig.tick(5.0)
        await eventually(lambda: not any(rig.pool.counts().values()))
        assert rig.backend.calls == [] and not rig.backend.alive


async def test_engines_reporting_waiting_requests_get_another_instance(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    backend = MetricsBackend(exposition=FULL)
    scaling = ScalingConfig(max=2, idle_timeout_s=600, stable_window_s=1)
    async with running_pool(tmp_path, tiny_model_dir, backend, scaling) as rig:
        rig.pool.request_arrived()
        rig.demand.now.queued = 1
        await rig.tick(0.0)
        await eventually(lambda: bool(rig.pool.endpoints()))
        [first] = rig.pool.endpoints()
        # one request in flight: the activator's counts ask for one instance, the engine's figures
        # (3 waiting inside it, KV cache 97 % full) for one more
        rig.demand.now.queued, rig.demand.now.in_flight = 0, 1
        rig.demand.now.outstanding = {first.id: 1}
        d = await decided(rig, 1.0, lambda d: d.ready == 2)
        assert d.reason == "saturated: 3 waiting inside the engines: 1 READY + 1"
        await eventually(lambda: len(rig.pool.endpoints()) == 2)
        # the first engine was read once however often the loop ticked: at most once per 5 s of
        # the pool's clock
        for _ in range(5):
            await rig.tick(5.9)
        assert backend.hits[first.port] == 1
        await rig.tick(6.0)
        await eventually(lambda: backend.hits[first.port] == 2)
        # both engines fine now: the figures no longer ask for more; the count alone keeps one
        # (after the rules' down delay, min(30, window) = 1 s, from the last step up)
        backend.exposition = IDLE
        d = await decided(rig, 12.0, lambda d: d.ready == 1)
        assert "saturated" not in d.reason
