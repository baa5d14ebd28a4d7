"""The instance operations of one deployment, on any backend: start (snapshot, command, process or
pod, ready check, what the engine can do), sleep, wake, stop, and adopt one a previous controller
left running. The pool (`warm_pool.pool`) decides when and keeps the states; this module does the
work and holds what each running instance needs (its handle, its snapshot pin, its GPUs), so that
a second backend (`warm_pool.backends.kube`) changes nothing here: the `Backend` protocol
(`warm_pool.backends.base`) is where the place an engine runs is named, and everything said to a running
engine is HTTP (`warm_pool.engine_calls`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from snapshots.pins import Pin
from warm_pool import engine_tls
from warm_pool.backends.base import Backend, Handle, Placement, Running
from warm_pool.engine_calls import EngineCapabilities, HttpEngines
from warm_pool.engine_settings import EngineSettings
from warm_pool.errors import PoolError
from warm_pool.launch import GpuInventory, LaunchSpec, cpu_engine_spec
from warm_pool.reconcile import Observed
from warm_pool.snapshot import Acquired, SnapshotSource
from warm_pool.states import Instance
from warm_pool.vllm import VllmLaunch
from warm_pool.vllm_starts import VllmStarts

log = logging.getLogger("stoker.pool")
SLEEP_LEVEL = 1  # weights kept in host RAM: a wake is a copy back, not a reload from disk


@dataclass(frozen=True)
class InstanceSettings:
    """What the operations need of the deployment's settings (the pool's `PoolSpec` has them)."""

    deployment: str
    snapshot: SnapshotSource
    engine: str  # "cpu" | "vllm"
    grace_period_s: float
    instance_concurrency: int
    start_timeout_s: float  # also bounds a sleep or a wake
    kill_timeout_s: float
    host: str
    threads: int | None
    vllm: VllmLaunch | None
    engine_settings: EngineSettings = field(default_factory=EngineSettings)


@dataclass
class Launch:
    """One start, as far as it got: `stage` names where it failed (`warm_pool.failures`)."""

    stage: str = "snapshot"
    acquired: Acquired | None = None
    snapshot_s: float = 0.0
    process_s: float = 0.0  # from the spawn to READY
    phases: dict[str, float] | None = None
    capabilities: EngineCapabilities | None = None
    from_runtime: bool = False  # a warm runtime took the start (`warm_pool.runtimes`)


class InstanceOps:
    def __init__(
        self,
        settings: InstanceSettings,
        backend: Backend,
        *,
        engines: HttpEngines | None = None,
        gpus: GpuInventory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings  # replaced by the pool when the deployment is reconfigured
        self.backend = backend
        self._engines = engines or HttpEngines(backend)
        self._gpus = gpus or GpuInventory([])
        self._clock = clock
        self._vllm = VllmStarts(
            settings.deployment, settings.snapshot, settings.vllm
        )  # specs and compile caches
        self._handles: dict[str, Handle] = {}
        # The part of a shared device an instance of this deployment reserves (`warm_pool.fleet`).
        self.share_of: Callable[[str], float | None] = lambda device: None
        self._pins: dict[str, Pin] = {}  # each instance's hold on its snapshot files

    def handle_name(self, inst: Instance) -> str | None:
        handle = self._handles.get(inst.id)
        return handle.name if handle is not None else None

    def held_up(self, inst: Instance) -> str | None:
        """Why its engine, started, is not serving yet, where the backend can tell (a pod Pending)."""
        handle = self._handles.get(inst.id)
        return None if handle is None else self.backend.held_up(handle)

    def is_alive(self, inst: Instance) -> bool | None:
        """Whether its engine still runs; None if it has none (not started, or stopped)."""
        handle = self._handles.get(inst.id)
        return None if handle is None else self.backend.is_alive(handle)

    async def launch(self, inst: Instance, launch: Launch, starting: Callable[[], None]) -> None:
        """Snapshot, command, engine, ready check; `starting()` once the engine is being started.
        Raises what stopped it (`launch.stage` says where); the caller then calls `stop`."""
        s, clock = self.settings, self._clock
        t0 = clock()
        acquired = launch.acquired = await self.backend.acquire(s.snapshot, inst.id)
        self._pins[inst.id] = acquired.pin
        launch.snapshot_s, launch.stage = clock() - t0, "process_start"
        if acquired.pulled is not None:
            log.info(
                "instance %s: pulled %s (%d bytes) in %.2fs",
                inst.id,
                acquired.pulled.uri,
                acquired.pulled.bytes_downloaded,
                launch.snapshot_s,
            )
        inst.port = self.backend.engine_port(s.host)
        spec = await self._spec(inst, acquired.path)
        starting()
        placement = Placement(
            inst.id,
            s.deployment,
            s.snapshot.snapshot_id,
            s.snapshot.remote,
            s.engine,
            len(self._gpus.held_by(inst.id)),
            s.host,
            inst.port,
            inst.secret,
            s.engine_settings,
        )
        handle = await self.backend.start(placement, spec)
        self._handles[inst.id] = handle
        launch.from_runtime = getattr(handle, "from_runtime", False)
        t1, launch.stage = clock(), "wait_ready"
        inst.address = await self.backend.wait_ready(handle, s.start_timeout_s, health_path=spec.health_path)
        launch.process_s = clock() - t1
        launch.phases = await self._engines.read_startup_phases(inst.url, inst.id, inst.auth_headers)
        launch.capabilities = await self._engines.read_capabilities(inst.url, inst.auth_headers)
        await self._vllm.keep(inst)

    async def adopt(self, inst: Instance, running: Running) -> tuple[Observed, EngineCapabilities]:
        """Take over an engine a previous controller started: whether it sleeps, what it can do.
        `Observed.UNKNOWN`/`UNAUTHORIZED`: it does not answer as ours; the caller stops it."""
        self._handles[inst.id] = running.handle
        inst.address = running.url
        observed = await self._engines.observe_sleep(inst.url, inst.auth_headers)
        caps = await self._engines.read_capabilities(inst.url, inst.auth_headers)
        return observed, caps

    async def sleep(self, inst: Instance) -> None:
        s = self.settings
        await self._engines.sleep(inst.url, SLEEP_LEVEL, s.start_timeout_s, inst.auth_headers)

    async def wake(self, inst: Instance) -> None:
        await self._engines.wake_up(inst.url, self.settings.start_timeout_s, inst.auth_headers)

    async def stop(self, inst: Instance) -> int | None:
        """Stop its engine (the engine drains on SIGTERM too: the grace period before the kill) and
        release what it held; its exit status where the backend knows it. Never cancelled halfway."""
        handle, code = self._handles.pop(inst.id, None), None
        if handle is not None:
            term = self.settings.grace_period_s + self.settings.kill_timeout_s
            code = await asyncio.shield(self.backend.stop(handle, term))
        self._gpus.release(inst.id)
        await self._vllm.discard(inst.id)
        if (pin := self._pins.pop(inst.id, None)) is not None:
            pin.release()
        return code

    async def close(self) -> None:
        await self._vllm.close()

    async def _spec(self, inst: Instance, snapshot_dir: Path) -> LaunchSpec:
        s, engine = self.settings, self.settings.engine_settings
        tls = engine_tls.of(self.backend)  # the engine serves HTTPS with the backend's files
        ssl_files = (tls.cert, tls.key) if tls is not None else None
        if s.engine == "vllm":
            share = self.share_of(inst.device) if inst.device is not None else None
            if share is not None and inst.device.startswith("gpu") and not self._vllm.cpu_build:
                # A shared GPU (`warm_pool.fleet`): its part of the device's memory, not the whole.
                gpus, extra = (
                    [int(inst.device.removeprefix("gpu"))],
                    ("--gpu-memory-utilization", f"{share:.3f}"),
                )
                return await self._vllm.spec(inst, snapshot_dir, gpus, s.host, engine, extra, ssl_files)
            n = engine.devices("vllm", self._vllm.cpu_build)
            # Tensor parallel: all of them or none, released together when the instance stops.
            gpus = self._gpus.acquire(n, inst.id) if n else []
            return await self._vllm.spec(inst, snapshot_dir, gpus, s.host, engine, ssl_files=ssl_files)
        n = engine.devices("cpu")
        gpus = self._gpus.acquire(n, inst.id) if n else []
        extra = ("--max-num-seqs", str(s.instance_concurrency), "--grace-period", f"{s.grace_period_s:g}")
        # Prefix KV kept across sleep and stop is the deployment's own: never read by another's engine.
        extra += ("--kv-keep-scope", s.deployment)
        if engine.max_model_len is not None:
            extra += ("--max-model-len", str(engine.max_model_len))
        if engine.dtype != "auto":
            extra += ("--dtype", engine.dtype)
        if engine.max_adapters is not None:
            extra += ("--max-adapters", str(engine.max_adapters))
        if engine.max_adapter_rank is not None:
            extra += ("--max-lora-rank", str(engine.max_adapter_rank))
        if engine.task != "generate":
            extra += ("--task", engine.task)
        if tls is not None:
            extra += tls.engine_args()
        return cpu_engine_spec(
            snapshot_dir,
            inst.port,
            s.deployment,
            host=s.host,
            threads=s.threads,
            extra_args=extra,
            api_key=inst.secret,
            gpus=gpus,
        )


def unreachable(observed: Observed) -> PoolError | None:
    """Why an engine found running cannot be adopted, or None if it can."""
    if observed is Observed.UNAUTHORIZED:
        return PoolError("it refuses the key recorded for it")
    if observed is Observed.UNKNOWN:
        return PoolError("it does not say whether it sleeps")
    return None
