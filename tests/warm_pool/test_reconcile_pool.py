"""The pool correcting what it believes by what its engines say of their sleep, step by step on a
fake clock: the real `Pool`, policy and `SleepStates`, with test_pool_sleep's in-memory `Backend`
and `Demand`, whose engines here also answer `GET /is_sleeping` over real HTTP on loopback, want
the instance's key, and can be slept, woken or re-keyed behind the pool's back.

The loop ticks only when poked; the reconcile interval is 5 s of the fake clock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from tests.activator.conftest import eventually
from tests.deadlines import deadline
from tests.warm_pool.rig import Rig, asleep, pool_rig
from warm_pool.backends.base import Placement
from warm_pool.backends.local import free_port
from warm_pool.backends.memory import MemoryBackend
from warm_pool.backends.procs import ProcessHandle
from warm_pool.launch import ENGINE_KEY_ENV, LaunchSpec
from warm_pool.policies.base import ScalingConfig

INTERVAL = 5.0


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@dataclass
class SleepyBackend(MemoryBackend):
    """Engines whose sleep is a flag: the pool's sleep and wake calls set it, and so can a test (as
    someone else holding the key would). Each serves `GET /is_sleeping` on its port, to its key only."""

    asleep: dict[int, bool] = field(default_factory=dict)  # port → engine asleep
    key: dict[int, str] = field(default_factory=dict)  # port → the key it wants
    answer: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # port → a canned answer instead
    gate: asyncio.Event | None = None  # while an Event, answers wait for it (with what was true before)
    asked: int = 0
    servers: dict[ProcessHandle, web.AppRunner] = field(default_factory=dict)

    def engine_port(self, host: str) -> int:
        # A free port, not the memory backend's fixed 20000, 20001 ...: every other pool test's
        # reconcile asks its own instances there, and on a shared loopback it would count here.
        return free_port()

    async def start(self, placement: Placement, spec: LaunchSpec) -> ProcessHandle:
        handle = await super().start(placement, spec)
        port = placement.port
        self.asleep[port], self.key[port] = False, spec.env[ENGINE_KEY_ENV]

        async def is_sleeping(request: web.Request) -> web.Response:
            self.asked += 1
            if request.headers.get("authorization") != f"Bearer {self.key[port]}":
                return web.json_response({"error": {"message": "Missing or invalid API key."}}, status=401)
            status, body = self.answer.get(port) or (
                200,
                b'{"is_sleeping": %s}' % str(self.asleep[port]).lower().encode(),
            )
            if self.gate is not None:
                await self.gate.wait()
            return web.Response(status=status, body=body)

        app = web.Application()
        app.router.add_get("/is_sleeping", is_sleeping)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.servers[handle] = runner
        return handle

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None:
        if (runner := self.servers.pop(handle, None)) is not None:
            await runner.cleanup()
        return await super().stop(handle, term_timeout_s)

    async def sleep(self, url: str, level: int, timeout_s: float, headers=None) -> None:
        await super().sleep(url, level, timeout_s, headers)
        self.asleep[_port(url)] = True

    async def wake_up(self, url: str, timeout_s: float, headers=None) -> None:
        await super().wake_up(url, timeout_s, headers)
        self.asleep[_port(url)] = False


@contextlib.asynccontextmanager
async def running(tmp_path: Path, model_dir: Path) -> AsyncIterator[Rig]:
    backend = SleepyBackend()
    scaling = ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1)
    try:
        async with pool_rig(
            tmp_path, model_dir, backend, scaling=scaling, reconcile_interval_s=INTERVAL
        ) as rig:
            yield rig
    finally:
        if backend.gate is not None:
            backend.gate.set()


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    async with running(tmp_path, tiny_model_dir) as rig:
        yield rig


async def ticks_until(rig: Rig, at: float, condition: Callable[[], bool]) -> None:
    """Tick at `at` until `condition` holds: a round of questions runs in the background, and its
    answers count at a later tick."""
    async with asyncio.timeout(deadline(10)):
        while not condition():
            await rig.tick(at)
            await asyncio.sleep(0.005)


async def answered(rig: Rig, at: float, asked: int) -> None:
    """Tick at `at` until the engines were asked `asked` times in all and that round's answers are
    in, then once more: the tick that reads them."""
    await ticks_until(
        rig, at, lambda: rig.backend.asked >= asked and not rig.pool.lifecycle.sleep_states.in_flight
    )
    await rig.tick(at)


def busy(rig: Rig, instance_id: str) -> None:
    """A request in flight on it: the policy keeps it READY however long the test's clock runs."""
    rig.demand.now.in_flight, rig.demand.now.outstanding = 1, {instance_id: 1}


def corrections(rig: Rig, believed: str, observed: str) -> float:
    return rig.sample("stoker_instance_state_corrections_total", believed=believed, observed=observed)


def port_of(rig: Rig, instance_id: str) -> int:
    return rig.pool.lifecycle.instances[instance_id].port


async def test_a_ready_instance_slept_by_someone_else_leaves_routing_and_is_woken(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    rig.backend.asleep[port_of(rig, first)] = True  # someone with the key POSTs /sleep
    changes = rig.demand.changes
    await ticks_until(rig, 1.0, lambda: corrections(rig, "READY", "asleep") == 1)
    assert rig.demand.changes > changes  # the activator was told the routing set changed
    # The policy still wants one READY: the pool wakes it through the usual path, a wake, not a start.
    await eventually(lambda: [i.id for i in rig.pool.endpoints()] == [first])
    assert [action for action, _ in rig.backend.calls] == ["wake"]
    assert rig.backend.asleep[port_of(rig, first)] is False
    assert rig.sample("stoker_instance_sleep_wake_total", action="wake", outcome="ok") == 1
    assert rig.sample("stoker_instance_starts_total", outcome="ready") == 1
    busy(rig, first)
    await answered(rig, 10.0, asked=2)  # asked again: nothing more to correct
    assert corrections(rig, "READY", "asleep") == 1
    assert [i.id for i in rig.pool.endpoints()] == [first]


async def test_a_sleeping_instance_woken_by_someone_else_joins_routing_and_the_policy_sleeps_it(
    rig: Rig,
) -> None:
    first = await rig.serve_one(0.0)
    await asleep(rig, 5.0)
    rig.backend.asleep[port_of(rig, first)] = False  # someone with the key POSTs /wake_up
    await ticks_until(rig, 10.0, lambda: corrections(rig, "SLEEPING", "awake") == 1)
    # Adopted as READY; the policy, which wants none READY, puts it back to sleep as any scale-down.
    await ticks_until(rig, 20.0, lambda: rig.pool.counts()["SLEEPING"] == 1)
    assert [action for action, _ in rig.backend.calls] == ["sleep", "sleep"]
    assert rig.backend.asleep[port_of(rig, first)] is True


async def test_an_engine_that_refuses_the_instance_key_is_replaced(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    rig.backend.key[port_of(rig, first)] = "another"  # it holds another key than the pool's
    await ticks_until(rig, 1.0, lambda: corrections(rig, "READY", "unauthorized") == 1)
    await eventually(lambda: first not in rig.pool.lifecycle.instances)
    assert rig.sample("stoker_instance_restarts_total") == 1
    rig.demand.now.queued = 1  # after the restart backoff (1 s), a fresh instance
    await ticks_until(rig, 3.0, lambda: bool(rig.pool.endpoints()))
    assert rig.pool.endpoints()[0].id != first


@pytest.mark.parametrize(
    "answer",
    [(500, b"oops"), (404, b"Not Found"), (200, b"not json"), (200, b'{"is_sleeping": "yes"}')],
)
async def test_an_answer_that_says_nothing_changes_nothing(rig: Rig, answer: tuple[int, bytes]) -> None:
    first = await rig.serve_one(0.0)
    busy(rig, first)
    rig.backend.answer[port_of(rig, first)] = answer
    rig.backend.asleep[port_of(rig, first)] = True  # even if it is in fact asleep
    await answered(rig, 1.0, asked=1)
    await answered(rig, 6.0, asked=2)
    assert [i.id for i in rig.pool.endpoints()] == [first]
    assert rig.registry.get_sample_value("stoker_instance_state_corrections_total", {}) is None
    assert rig.backend.calls == []


async def test_the_tick_never_waits_for_an_answer_and_one_round_at_a_time(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    busy(rig, first)
    rig.backend.gate = asyncio.Event()  # the engine takes its time to answer
    await ticks_until(rig, 1.0, lambda: rig.backend.asked == 1)
    for at in (7.0, 13.0, 19.0):  # each past the interval: the loop decides, asks nothing new
        await rig.tick(at)
    assert rig.backend.asked == 1 and rig.pool.lifecycle.sleep_states.in_flight
    rig.backend.gate.set()
    await answered(rig, 19.0, asked=1)
    await answered(rig, 25.0, asked=2)
    assert [i.id for i in rig.pool.endpoints()] == [first]


async def test_an_answer_that_crossed_the_pools_own_sleep_is_not_applied(rig: Rig) -> None:
    first = await rig.serve_one(0.0)
    rig.backend.gate = asyncio.Event()
    await ticks_until(rig, 1.0, lambda: rig.backend.asked == 1)  # asked while READY: "awake"
    await asleep(rig, 5.0)  # meanwhile the pool puts it to sleep itself
    rig.backend.gate.set()  # the stale "awake" arrives now
    await answered(rig, 5.0, asked=1)  # and is read, and dropped, here
    assert rig.pool.counts()["SLEEPING"] == 1 and rig.pool.endpoints() == []
    assert corrections(rig, "SLEEPING", "awake") == 0
    # The next round, on the settled state, finds nothing to correct either.
    await answered(rig, 11.0, asked=2)
    assert rig.pool.counts()["SLEEPING"] == 1 and corrections(rig, "SLEEPING", "awake") == 0
    assert [action for action, _ in rig.backend.calls] == ["sleep"]
    assert first in rig.pool.lifecycle.instances
