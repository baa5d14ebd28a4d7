"""Where instances run: the `Backend` protocol, which every backend (local processes, Kubernetes
pods) implements, and the values that cross it.

A backend owns only what differs between places: getting the snapshot where the engine will read
it, starting the engine, telling whether it still runs, when it is ready and at what address,
stopping it, and finding the instances a previous controller left running so that the next one
adopts them instead of starting over. Everything said to a running engine (sleep, wake, its
capabilities, its start-up phases) is HTTP to its address and the same on every backend
(`warm_pool.engine_calls`). The pool sees a `Handle` only as an opaque name: no PIDs, no pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from warm_pool.engine_settings import EngineSettings
from warm_pool.engine_tls import EngineTls
from warm_pool.launch import LaunchSpec
from warm_pool.policies.base import Tier
from warm_pool.snapshot import Acquired, SnapshotSource


class Handle(Protocol):
    """One running engine, as its backend names it. Hashable and comparable (a frozen dataclass)."""

    @property
    def name(self) -> str: ...  # for people and logs: "pid 4242", "pod stoker/smollm2-1a2b3c4d"


@dataclass(frozen=True)
class Placement:
    """What a backend is told of the instance it starts, beyond the command to run."""

    instance_id: str  # `<deployment>-<8 hex>`: a pod's name, a log file's name
    deployment: str
    snapshot_id: str
    snapshot_uri: str | None  # s3://… a node without the snapshot pulls it from; None: local only
    engine: str  # "cpu" | "vllm"
    gpus: int  # accelerators it needs (a pod's `nvidia.com/gpu` request)
    host: str  # the address the engine binds (the local backend also reaches it there)
    port: int  # the port the engine listens on (`Backend.engine_port`)
    secret: str  # the engine's key (`LaunchSpec.secret_env` names where the spec carries it)
    # The deployment's engine settings: a pod's CPU and memory requests, node selector, tolerations.
    engine_settings: EngineSettings = field(default_factory=EngineSettings)


@dataclass(frozen=True)
class Running:
    """An instance found running that a previous controller started: adopted, never restarted.
    Only what the backend itself recorded (labels, records) is believed; its state (READY or
    SLEEPING) is asked of the engine at adoption."""

    instance_id: str
    deployment: str
    snapshot_id: str
    handle: Handle
    url: str
    secret: str
    started_at: float  # wall-clock seconds (time.time())


class Backend(Protocol):
    kind: str  # "local" | "kubernetes": shown to operators, never branched on by the pool
    # How its engines serve TLS and are verified (`warm_pool.engine_tls`); None: plain HTTP.
    engine_tls: EngineTls | None

    def engine_port(self, host: str) -> int:
        """The port the next engine listens on: a free local port, or a pod's fixed port."""
        ...

    async def acquire(self, snapshot: SnapshotSource, holder: str) -> Acquired:
        """The snapshot where the engine will read it, pinned for `holder` (released by the pool):
        pulled into the local store, or (pods) left to the node, with the path it will have there."""
        ...

    async def start(self, placement: Placement, spec: LaunchSpec) -> Handle:
        """Start the engine; returns at once (it loads in the background). Records it so that
        `running` finds it after a controller restart."""
        ...

    def is_alive(self, handle: Handle) -> bool:
        """Still running (cheap, no I/O that can block: called every tick for every instance)."""
        ...

    async def wait_ready(self, handle: Handle, timeout_s: float, *, health_path: str) -> str:
        """Wait until the engine answers 200 on `health_path`; its base URL (http(s)://host:port).
        `StartFailed` (with the log's tail and the phase it reached) if it exits or times out."""
        ...

    async def stop(self, handle: Handle, term_timeout_s: float) -> int | None:
        """Stop it (SIGTERM / pod deletion with `term_timeout_s` of grace, then kill) and forget its
        record; its exit status where known. Safe to repeat, and on the already gone."""
        ...

    async def running(self) -> list[Running]:
        """Every instance a previous run of this controller left running (and whose record is
        whole): the platform adopts those of deployments it still has and stops the rest."""
        ...

    async def aclose(self) -> None:
        """Let go of what the backend itself holds (connections, watches); instances run on."""
        ...

    async def read_log(self, instance_id: str, max_bytes: int) -> str | None:
        """The last `max_bytes` of the instance's engine log; None if there is none to read. (vLLM
        says how its start went only there: `warm_pool.vllm.startup_phases`.)"""
        ...

    def held_up(self, handle: Handle) -> str | None:
        """Why an engine started but not yet serving is held up, where the backend can tell (a pod
        the scheduler finds no node for, an image not pulled); None otherwise. Cheap, no I/O."""
        ...

    async def device_capacity(self) -> tuple[int, str] | None:
        """The most GPUs one instance can ever be given here (on one node), and where that figure
        comes from, for a deploy that asks more; None: the platform's own inventory says (this
        machine's GPUs)."""
        ...


def start_tier(snapshot_tier: Tier, from_runtime: bool) -> Tier:
    """The tier a start came from: `RUNTIME` when a warm runtime took it and the snapshot was on
    this machine already (page cache or disk); otherwise the snapshot's tier (a download dwarfs the
    imports a runtime saves, and a fresh process is no runtime). Pure.

    | snapshot tier | from a runtime | start tier |
    |---|---|---|
    | page_cache | yes | runtime |
    | disk | yes | runtime |
    | object_storage | yes | object_storage |
    | page_cache | no | page_cache |
    """
    if from_runtime and snapshot_tier in (Tier.PAGE_CACHE, Tier.DISK):
        return Tier.RUNTIME
    return snapshot_tier


def runtime_ready(backend: Backend, engine: str) -> bool:
    """Whether `backend` holds a warm runtime that a start of `engine` would take now. Only the local
    backend keeps runtimes (its `runtimes`, a `warm_pool.runtimes.RuntimeKeeper`); on any other
    every start is a fresh process."""
    keeper = getattr(backend, "runtimes", None)
    return keeper is not None and keeper.ready(engine) > 0
