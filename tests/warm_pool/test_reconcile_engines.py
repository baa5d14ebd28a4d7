"""The pool's sleep-state checks against real engines: real CPU engine processes on the tiny model,
started by the real `Pool` through the `LocalBackend`, and requests through the real `Activator`
behind the smallest gateway (tests/activator's `Front`), on loopback. Someone other than the pool,
holding an instance's key (read, as its owner may, from the engine's environment), sleeps or wakes
its engine; the pool must notice and act through its usual paths.

The activator's /health probes are not run: the CPU engine's /health answers 503 while asleep, so
they would also notice a READY instance put to sleep, and replace it; here only the pool's own
check can. Waits poll for an outcome with generous timeouts; nothing here asserts on speed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
from prometheus_client import CollectorRegistry

from activator import Activator, ActivatorConfig, ActivatorMetrics
from snapshots import SnapshotStore, import_hf_dir
from tests.activator.conftest import Front
from tests.activator.conftest import running as serving
from tests.deadlines import deadline
from warm_pool.backends.local import LocalBackend
from warm_pool.backends.records import InstanceRecord, InstanceRecords
from warm_pool.launch import ENGINE_KEY_ENV
from warm_pool.metrics import PoolMetrics
from warm_pool.policies.base import ScalingConfig
from warm_pool.pool import Pool, PoolSpec
from warm_pool.snapshot import SnapshotSource

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 2}
WAIT_S = deadline(60)  # a CPU engine starts in seconds; a shared 2-core machine may take several times that


@dataclass
class Stack:
    pool: Pool
    records: InstanceRecords
    client: httpx.AsyncClient  # to the front: a client of the platform
    outsider: httpx.AsyncClient  # straight to an engine: someone else holding its key
    registry: CollectorRegistry

    async def complete(self) -> httpx.Response:
        r = await self.client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        return r

    def record(self, instance_id: str) -> InstanceRecord:
        [record] = [r for r in self.records.all() if r.id == instance_id]
        return record

    async def is_sleeping(self, instance_id: str) -> bool:
        record = self.record(instance_id)
        r = await self.outsider.get(f"{record.url}/is_sleeping", headers=engine_key(record.pid))
        assert r.status_code == 200, r.text
        return r.json()["is_sleeping"]

    async def outside_post(self, instance_id: str, path: str) -> None:
        record = self.record(instance_id)
        r = await self.outsider.post(f"{record.url}{path}", headers=engine_key(record.pid))
        assert r.status_code == 200, r.text

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"deployment": "tiny", **labels}) or 0.0

    def corrections(self, believed: str, observed: str) -> float:
        return self.sample("stoker_instance_state_corrections_total", believed=believed, observed=observed)


def engine_key(pid: int) -> dict[str, str]:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    return {"authorization": f"Bearer {env[ENGINE_KEY_ENV.encode()].decode()}"}


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                if condition():
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s:g}s: {what}") from None


@pytest.fixture
async def stack(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    store = SnapshotStore(tmp_path / "store")
    record = import_hf_dir(tiny_model_dir, store)
    registry, records = CollectorRegistry(), InstanceRecords(tmp_path / "instances")
    spec = PoolSpec(
        "tiny",
        SnapshotSource(store, record.id),
        # Predictive, as deployed by default; a 1 s window puts an idle instance to sleep soon.
        scaling=ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1),
        grace_period_s=5,
        reconcile_interval_s=0.5,
        threads=1,
    )
    pool = Pool(spec, LocalBackend(tmp_path / "logs", records=records), PoolMetrics(registry), tick_s=0.25)
    front = Front()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
    loop: asyncio.Task | None = None
    try:
        async with serving(front) as (url,):
            front.activator = Activator("tiny", pool, ActivatorConfig(), session, ActivatorMetrics(registry))
            pool.attach(front.activator)
            loop = asyncio.create_task(pool.run())
            async with (
                httpx.AsyncClient(base_url=url, timeout=deadline(120)) as client,
                httpx.AsyncClient(timeout=deadline(30)) as outsider,
            ):
                yield Stack(pool, records, client, outsider, registry)
    finally:
        await pool.close(drain=False)
        if loop is not None:
            await loop
        await session.close()


async def test_an_engine_slept_behind_the_pools_back_leaves_routing_and_is_woken_for_the_next_request(
    stack: Stack,
) -> None:
    instance = (await stack.complete()).headers["x-stoker-instance"]
    await stack.outside_post(instance, "/sleep?level=1")

    await until(lambda: stack.corrections("READY", "asleep") == 1, "the pool sees it asleep")
    # Out of routing, SLEEPING in the pool's books, then woken through the usual path (the policy
    # still wants one READY after a request this recent): a wake, not a restart.
    answer = await stack.complete()
    assert answer.headers["x-stoker-instance"] == instance
    assert not await stack.is_sleeping(instance)
    assert stack.sample("stoker_instance_seconds_total", state="SLEEPING") > 0
    assert stack.sample("stoker_instance_startup_seconds_count", tier="wake") >= 1
    assert stack.sample("stoker_instance_starts_total", outcome="ready") == 1
    assert stack.corrections("READY", "asleep") == 1  # corrected once, not on every round


async def test_an_engine_woken_behind_the_pools_back_is_taken_back_and_put_to_sleep_again(
    stack: Stack,
) -> None:
    instance = (await stack.complete()).headers["x-stoker-instance"]
    await until(lambda: stack.pool.counts()["SLEEPING"] == 1, "the idle instance put to sleep by the pool")
    assert await stack.is_sleeping(instance)
    await stack.outside_post(instance, "/wake_up")

    await until(lambda: stack.corrections("SLEEPING", "awake") == 1, "the pool sees it awake")
    # Adopted as READY; unwanted by the policy, it goes back to sleep as any scale-down does.
    ok_sleeps = {"action": "sleep", "outcome": "ok"}
    await until(lambda: stack.sample("stoker_instance_sleep_wake_total", **ok_sleeps) >= 2, "asleep again")
    await until(lambda: stack.pool.counts()["SLEEPING"] == 1, "SLEEPING in the pool's books")
    assert await stack.is_sleeping(instance)
    # And a request still finds it: woken by the pool, the same process.
    pid = stack.record(instance).pid
    answer = await stack.complete()
    assert answer.headers["x-stoker-instance"] == instance and stack.record(instance).pid == pid
    assert stack.corrections("SLEEPING", "awake") == 1
