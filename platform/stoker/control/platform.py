"""The composition root: builds each deployment's activator and warm pool and wires them together.

    registry (SQLite) ──▶ Platform ──▶ per deployment: Activator ◀──▶ Pool ──▶ LocalBackend
                                         (InstanceSource / Demand)        (engine processes)

The activator and the pool never import each other: the activator sees the pool as its
`InstanceSource`, the pool sees the activator as its `Demand`. Everything is built here, once, and
handed down; nothing is looked up in globals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from activator import Activator, ActivatorConfig, ActivatorMetrics
from snapshots import (
    SnapshotError,
    SnapshotStore,
)
from snapshots.s3 import RemoteConfig
from stoker.control.adapters import AdapterDeployment, AdapterDeployments
from stoker.control.cluster import GatewayLoad, RoutingTable
from stoker.control.cost import CostMeter
from stoker.control.deployment import Deployment, Unit
from stoker.control.devices import check_devices
from stoker.control.federate import EngineFederation, Target
from stoker.control.models import resolve_model
from stoker.control.policy_states import PolicyStates
from stoker.control.prices import PriceTable
from stoker.control.registry import DeploymentStore, Registry
from stoker.control.rollout import Rollout, canary_percent
from stoker.control.vllm import VllmOptions, VllmSetup
from stoker.errors import APIError, invalid
from stoker.gateway.revisions import RevisionMetrics, RevisionStats
from stoker.paths import snapshot_budget
from stoker.spec.deployment import DeploymentSpec, not_found, validate
from warm_pool.backends.base import Backend, Running
from warm_pool.backends.local import LocalBackend
from warm_pool.backends.records import InstanceRecords
from warm_pool.engine_tls import EngineTls
from warm_pool.engine_tls import connector as engine_connector
from warm_pool.errors import PoolError
from warm_pool.fleet import Devices, Fleet, Footprint, footprint
from warm_pool.launch import GpuInventory
from warm_pool.metrics import PoolMetrics
from warm_pool.policies.base import ScalingConfig
from warm_pool.pool import Pool, PoolSpec
from warm_pool.runtimes import cpu_keeper
from warm_pool.snapshot import SnapshotSource

log = logging.getLogger("stoker.platform")


class Platform:
    def __init__(
        self,
        data_dir: Path,
        *,
        store_dir: Path | None = None,  # the snapshot store; default <data_dir>/snapshots
        activator_config: ActivatorConfig | None = None,
        stable_window_s: float = 60.0,
        vllm: VllmOptions | None = None,
        unavailable_after: int = 3,  # failed starts in a row before held requests hear why (0: never)
        clock: Callable[[], float] = time.monotonic,
        backend: Backend | None = None,
        gpus: GpuInventory | None = None,  # the devices instances get; default: this machine's
        devices: Devices | None = None,  # shared device memory (`warm_pool.fleet`); None: whole devices
        instance_kv_bytes: int = 256 << 20,  # each instance's KV-cache budget, with shared devices
        controller: bool = False,  # the control plane only: gateways run the activators (`stoker.control.cluster`)
        gateway_stale_after_s: float = 5.0,
        gateway_silent_grace_s: float | None = None,
        canary_check_s: float = 1.0,  # how often canaries that ask for it are judged
        prices: PriceTable | None = None,  # `stoker up --prices` (`stoker.control.cost`); None: list prices
        max_instance_age_s: float | None = None,  # `stoker up --max-instance-age`; a deployment's own wins
        warm_runtimes: int = 0,  # CPU-engine runtimes kept ahead of need (`stoker up --warm-runtimes`)
        stopping: Callable[[], bool] | None = None,  # the server draining (`stoker.http.ServerStopping`)
        engine_tls: EngineTls | None = None,  # engines serve HTTPS, verified so (`warm_pool.engine_tls`)
        registry: DeploymentStore
        | None = None,  # default: SQLite in the data dir; on a cluster, the API server
    ) -> None:
        self.data_dir = data_dir
        self.controller = controller
        # What gateways wait on and report to, in a controller (`stoker.control.cluster`).
        self.routes = RoutingTable(
            clock, stale_after_s=gateway_stale_after_s, silent_grace_s=gateway_silent_grace_s
        )
        self.registry: DeploymentStore = registry or Registry(data_dir / "stoker.db")
        self.store = SnapshotStore(store_dir or data_dir / "snapshots", budget_bytes=snapshot_budget())
        self.records = InstanceRecords(data_dir / "instances")
        # Marks its engines, so the next run on this data dir finds even those it never recorded.
        owner = str(data_dir.resolve())
        self.metrics_registry = CollectorRegistry()
        self.fleet = Fleet(devices, self.metrics_registry) if devices is not None else None
        # Where instances run: engine processes here, warm runtimes first (`warm_pool.runtimes`), unless given another (pods).
        count = 0 if backend else warm_runtimes
        vllm_runtimes = 0 if backend or vllm is None else vllm.warm_runtimes
        keeper = cpu_keeper(
            count, data_dir / "logs", owner, self.metrics_registry, self.fleet, keep=vllm_runtimes > 0
        )
        self._keeper = keeper  # vLLM's runtimes join it at the first vLLM deployment
        self.backend: Backend = backend or LocalBackend(
            data_dir / "logs",
            clock=clock,
            owner=owner,
            records=self.records,
            runtimes=keeper,
            engine_tls=engine_tls,
        )
        self.engine_tls = self.backend.engine_tls  # the backend's: how its engines are reached
        self.gpus = gpus or GpuInventory.from_env()
        self._kv_bytes = instance_kv_bytes
        self._activator_metrics = ActivatorMetrics(self.metrics_registry)
        self._pool_metrics = PoolMetrics(self.metrics_registry)
        self._federation = EngineFederation(
            self.metrics_registry, engine_tls=self.engine_tls
        )  # GET /metrics/engines
        self.revision_metrics = RevisionMetrics(self.metrics_registry)
        # Instance-seconds priced per revision, tokens, idle share, the arrival log (`stoker.control.cost`).
        self.cost = CostMeter.of_platform(prices, self.metrics_registry, clock, self.store, data_dir)
        # What each pool's policy learned, for the checkpoints and back (`stoker.control.policy_states`).
        self.policy_states = PolicyStates(self.pools, clock)
        self._left: list[tuple[str, Pool]] | None = None  # the pools as shutdown left them
        self.rollout = Rollout(self, check_interval_s=canary_check_s)
        self.adapters = AdapterDeployments(self, self.metrics_registry)  # LoRA adapters on the bases
        self._activator_config = activator_config or ActivatorConfig()
        self._stable_window_s = stable_window_s
        self._max_instance_age_s = max_instance_age_s
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._deployments: dict[str, Deployment] = {}
        self._lock = asyncio.Lock()  # deploys and removals one at a time
        # The vLLM this platform runs: found at the first vLLM deployment, then kept.
        self._vllm_setup = VllmSetup(vllm or VllmOptions(), self.gpus, self._keeper)
        self.unavailable_after = unavailable_after
        # Whether the server is draining (its uvicorn's should_exit, once `serve` binds it): open
        # `stoker logs --follow` streams end then, instead of holding the drain for its grace period.
        self.stopping: Callable[[], bool] = stopping or (lambda: False)

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @property
    def hold_deadline_s(self) -> float:
        return self._activator_config.hold_deadline_s

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        # One connection pool for every upstream request; no total timeout (long generations are
        # normal), the activator sets connect, first-byte and between-chunk deadlines itself.
        connector = engine_connector(self.engine_tls, limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        running = await self.backend.running()
        latest = {spec.name: spec for spec in self.registry.all()}
        revisions = self.registry.serving()  # that had traffic: the models', then the adapters'
        for spec in (s for s in revisions if s.base is None):
            source = self._source(spec.snapshot_id, spec.model)
            if source.remote is None and not source.is_local():
                log.error(
                    "deployment %s revision %d not restored: its snapshot %s is no longer in the store",
                    spec.name,
                    spec.revision,
                    spec.snapshot_id[:12],
                )
                continue
            try:
                if spec.engine == "vllm":
                    await self._vllm_setup.launch()
                mine = [r for r in running if (r.deployment, r.snapshot_id) == (spec.name, spec.snapshot_id)]
                d = self._deployments.get(spec.name)
                if d is None:
                    d = self._deployment(latest[spec.name], {})
                d.units[spec.revision] = self.new_unit(spec, adopt=mine)
                d.traffic = self.registry.traffic(spec.name)
                running = [r for r in running if r not in mine]
            except PoolError as exc:  # e.g. a policy this version no longer has
                log.error("deployment %s not restored: %s", spec.name, exc)
            except APIError as exc:  # the vLLM it ran on is gone
                log.error("deployment %s not restored: %s", spec.name, exc.message)
        for name, d in list(self._deployments.items()):
            if not d.units:  # none of its revisions could come back
                del self._deployments[name]
                continue
            serving = {r: p for r, p in d.traffic.items() if r in d.units}
            self.rollout.publish(d, serving if serving != d.traffic and serving else None)
            running = self.rollout.resume(d, running)  # a switch the last run left under way
        for spec in (s for s in revisions if s.base is not None):
            if spec.base in self._deployments:
                self.adapters.restore(spec, latest[spec.name])
            else:
                log.error(
                    "adapter deployment %s not restored: its base %s did not come back", spec.name, spec.base
                )
        self.rollout.start()
        await self._stop_unclaimed(running)

    async def _stop_unclaimed(self, running: list[Running]) -> None:
        """Engines a previous run left for deployments that are gone or serve another snapshot now."""
        for r in running:
            log.warning(
                "stopping instance %s (%s) left by a previous run: not adopted", r.instance_id, r.handle.name
            )
        await asyncio.gather(*(self.backend.stop(r.handle, 10.0) for r in running), return_exceptions=True)

    async def shutdown(self, *, stop_instances: bool = True) -> None:
        """Drain every deployment's instances (each within its grace period) and stop them; or, for a
        controller that hands over to the next one, leave them running to be adopted."""
        await self.rollout.stop()
        deployments = list(self._deployments.values())
        outcomes = await asyncio.gather(
            *(self._stop(d, stop_instances=stop_instances) for d in deployments), return_exceptions=True
        )
        for d, outcome in zip(deployments, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.error("deployment %s did not stop cleanly: %r", d.spec.name, outcome)
        self._left = self.pools()  # for the shutdown's checkpoint, which follows
        self._deployments.clear()
        await self._federation.aclose()
        await self.backend.aclose()
        if self._session is not None:
            await self._session.close()
        self.registry.close()

    # ---- deployments -------------------------------------------------------------------------------

    def base(self, name: str) -> Deployment | None:
        """A model's deployment (one an adapter may run on)."""
        return self._deployments.get(name)

    def get(self, name: str) -> Deployment | AdapterDeployment | None:
        """A model's deployment, or an adapter's (`stoker.control.adapters`)."""
        return self._deployments.get(name) or self.adapters.get(name)

    def list(self) -> list[Deployment]:
        return list(self._deployments.values())

    def pools(self) -> list[tuple[str, Pool]]:
        """Every unit's pool by `name@revision` (the revision it serves now); after `shutdown`,
        the pools it stopped, as they were left."""
        if self._left is not None:
            return list(self._left)
        return [(f"{d.name}@{r}", unit.pool) for d in self.list() for r, unit in d.units.items()]

    def engine_targets(self) -> list[Target]:
        """Every instance's engine that serves HTTP now (READY, SLEEPING, DRAINING), with its
        deployment, revision and key (`stoker.control.federate`): an asleep engine's `engine_sleep_state`
        and a draining one's last requests are what an operator looks for."""
        return [
            Target(d.name, str(unit.spec.revision), inst.id, inst.url, inst.auth_headers)
            for d in self.list()
            for unit in d.units.values()
            for inst in unit.pool.engines()
        ]

    async def engine_metrics(self) -> bytes:
        """Every serving instance's engine metrics, federated now (`stoker.control.federate`)."""
        return await self._federation.scrape(self.engine_targets())

    async def deploy(
        self, body: object, name_taken: Callable[[str], APIError | None] = lambda name: None
    ) -> tuple[DeploymentSpec, bool]:
        """Create a deployment, or update one: every deploy is a new revision. One that the running
        instances can serve as they are (the same snapshot and engine) takes over at once; another
        model or engine warms first and takes the traffic once it is READY (`stoker.control.rollout`).
        `name_taken`: why the name is another kind of thing's (a cascade route's), or None; the
        admin API passes it. Returns the new revision's spec and whether the deployment was created."""
        fields = validate(body)
        if (taken := name_taken(fields["name"])) is not None:
            raise taken
        canary = canary_percent(body)
        if canary is not None and self.get(fields["name"]) is None:
            raise invalid(
                f"'canary_percent' needs a deployment to split with; {fields['name']!r} is new.",
                "canary_percent",
            )
        if fields.get("base") is not None:  # a LoRA adapter, on its base's instances
            async with self._lock:
                return await self.adapters.deploy(fields, canary)
        self.adapters.check_free(fields["name"])
        self.adapters.check_serves(fields)
        if fields["engine"] == "vllm":
            await self._vllm_setup.launch()
        await self._check_devices(fields)
        async with self._lock:
            snapshot_id = await self._resolve_model(fields["model"])
            if fields["engine"] == "vllm":
                await self._vllm_setup.check_can_load(self.store, snapshot_id, fields["model"])
            spec = DeploymentSpec.from_dict({**fields, "snapshot_id": snapshot_id})
            current = self._deployments.get(spec.name)
            if current is None:
                spec = await self.registry.put(spec)
                d = self._deployment(spec, {spec.revision: 100})
                d.units[spec.revision] = self.new_unit(spec)
                self.rollout.publish(d, d.traffic)
                return spec, True
            spec = await self.registry.create_revision(spec)
            current.latest = spec
            self.rollout.switch_to(current, spec, canary or 100)
            return spec, False

    async def apply(
        self, body: object, name_taken: Callable[[str], APIError | None] = lambda name: None
    ) -> DeploymentSpec | None:
        """A declared deployment (a resource's spec, `stoker.control.kube.reconcile`): deployed as
        `deploy` does, unless its newest revision already is what `body` declares (None then)."""
        fields = validate(body)
        d = self.get(fields["name"])
        if d is not None:
            latest = d.latest
            same = DeploymentSpec.from_dict(
                {**fields, "snapshot_id": latest.snapshot_id, "revision": latest.revision}
            )
            if same == latest:
                return None
        spec, _ = await self.deploy(body, name_taken)
        return spec

    async def _check_devices(self, fields: dict[str, Any]) -> None:
        found = self._vllm_setup.found
        cpu_build = found is not None and found.runtime.cpu_build
        await check_devices(
            fields, cpu_build, shared=self.fleet is not None, backend=self.backend, gpus=self.gpus
        )

    async def set_traffic(self, name: str, split: object) -> Deployment:
        """`stoker traffic`: split the traffic between revisions by percent (`stoker.control.rollout`)."""
        async with self._lock:
            if (a := self.adapters.get(name)) is not None:
                self.adapters.split(a, split)
                return a
            d = self._existing(name)
            self.rollout.split(d, split, self.registry.revisions(name))
            return d

    async def rollback(self, name: str, to: int | None) -> DeploymentSpec:
        """Back to revision `to` (default: the one before the primary), warm before the switch."""
        async with self._lock:
            if (a := self.adapters.get(name)) is not None:
                return self.adapters.rollback(a, to)
            d = self._existing(name)
            target = self.rollout.rollback_target(d, to, self.registry.revisions(name))
            self.check_snapshot(target)
            self.rollout.switch_to(d, target)
            return target

    def revisions(self, name: str) -> list[dict]:
        if (a := self.adapters.get(name)) is not None:
            return self.adapters.revision_rows(a)
        d = self._existing(name)
        return d.revision_rows(self.registry.revisions(name))

    def _existing(self, name: str) -> Deployment:
        d = self._deployments.get(name)
        if d is None:
            raise not_found(name)
        return d

    def check_snapshot(self, spec: DeploymentSpec) -> None:
        source = self._source(spec.snapshot_id, spec.model)
        if source.remote is None and not source.is_local():
            raise APIError(
                409,
                f"Revision {spec.revision}'s snapshot {spec.snapshot_id[:12]} is no longer in the store; "
                "import it again first.",
                param="to",
                code="snapshot_gone",
            )

    async def remove(self, name: str) -> DeploymentSpec:
        """Drain every revision's instances, then forget the deployment and its revisions."""
        async with self._lock:
            if self.adapters.get(name) is not None:
                return await self.adapters.remove(name)
            self.adapters.check_unused(name)
            deployment = self._existing(name)
            await self.rollout.cancel(deployment)
            await self._stop(deployment)
            await self.registry.delete(name)
            del self._deployments[name]
            self.routes.bump()
            self._pool_metrics.forget(name)
            return deployment.spec

    def _deployment(self, latest: DeploymentSpec, traffic: dict[int, int]) -> Deployment:
        d = Deployment(
            latest.name,
            latest,
            {},
            traffic,
            RevisionStats(latest.name, self.revision_metrics, self._clock),
            self._clock,
        )
        self._deployments[latest.name] = d
        return d

    def new_unit(self, spec: DeploymentSpec, adopt: list[Running] = (), min_warm: int | None = None) -> Unit:
        """A pool (and, in one process, an activator) for one revision; running at once. Its engine's
        warm runtimes are kept from now on (`RuntimeKeeper.want`)."""
        if self._keeper is not None:
            self._keeper.want(spec.engine)
        pool = Pool(
            PoolSpec(
                deployment=spec.name,
                snapshot=self._source(spec.snapshot_id, spec.model),
                engine=spec.engine,
                scaling=self.scaling(spec, min_warm),
                policy=spec.policy,
                grace_period_s=spec.grace_period_s,
                vllm=self._vllm_setup.found if spec.engine == "vllm" else None,
                unavailable_after=self.unavailable_after,
                footprint=self._footprint(spec) if self.fleet is not None else None,
                revision=spec.revision,
                max_instance_age_s=self.max_instance_age(spec),
                engine_settings=spec.engine_settings,
            ),
            self.backend,
            self.cost.pool_metrics(self._pool_metrics, spec),
            gpus=self.gpus,
            clock=self._clock,
            fleet=self.fleet,
        )
        self.policy_states.take(f"{spec.name}@{spec.revision}", pool)  # what a previous run learned
        loop = asyncio.create_task(_adopt_then_run(pool, adopt), name=f"pool-{pool.name}")
        if self.controller:
            demand = GatewayLoad(pool.name, self.routes, self._clock)
            demand.pool = pool
            pool.attach(demand)
            self.adapters.listen_remote(pool, spec.name, demand.load, lambda: self._session)
            unit = Unit(spec, pool, None, loop, None, demand)
        else:
            activator = Activator(
                spec.name,
                pool,
                self._activator_config,
                self._session,
                self._activator_metrics,
                clock=self._clock,
            )
            self.rollout.configure(activator, spec)
            self.adapters.listen(activator, spec.name, pool)  # the adapters it serves
            pool.attach(activator)
            health = asyncio.create_task(activator.watch_health(), name=f"health-{pool.name}")
            unit = Unit(spec, pool, activator, loop, health)
        self.routes.bump()
        return unit

    async def _stop(self, deployment: Deployment, *, stop_instances: bool = True) -> None:
        await asyncio.gather(
            *(self.stop_unit(u, stop_instances=stop_instances) for u in deployment.units.values())
        )

    async def stop_unit(self, unit: Unit, *, stop_instances: bool = True) -> None:
        if unit.health is not None:
            unit.health.cancel()
        await unit.pool.close(drain=True, stop_instances=stop_instances)
        await unit.loop

    def pool_gone(self, unit: Unit) -> None:
        self._pool_metrics.pool_gone(unit.pool.name)
        self.routes.bump()

    def _footprint(self, spec: DeploymentSpec) -> Footprint:
        """What one instance reserves on a shared device: the snapshot's weights and the KV budget."""
        try:
            files = self.store.manifest(spec.snapshot_id).files
        except SnapshotError:  # in object storage only, not pulled yet: its weights are unknown here
            files = []
        weights = sum(f.size for f in files if f.path.endswith(".safetensors"))
        return footprint(weights, self._kv_bytes, spec.engine)

    def max_instance_age(self, spec: DeploymentSpec) -> float:
        """A revision's maximum instance age (`warm_pool.recycle`): its own, else the platform's; 0: off."""
        return spec.max_instance_age_s or self._max_instance_age_s or 0.0

    def scaling(self, spec: DeploymentSpec, min_warm: int | None = None) -> ScalingConfig:
        """A revision's scaling bounds; `min_warm` raised while it warms before a switch."""
        return ScalingConfig(
            min_warm=spec.min_warm if min_warm is None else min(spec.max, max(spec.min_warm, min_warm)),
            max=spec.max,
            target_concurrency=spec.target_concurrency,
            idle_timeout_s=spec.idle_timeout_s,
            stable_window_s=min(self._stable_window_s, spec.idle_timeout_s),
        )

    # ---- models ------------------------------------------------------------------------------------

    async def _resolve_model(self, model: str, param: str = "model") -> str:
        return await resolve_model(self.store, model, param)

    def _source(self, snapshot_id: str, model: str) -> SnapshotSource:
        remote = model if model.startswith("s3://") else None
        return SnapshotSource(self.store, snapshot_id, remote, RemoteConfig.from_env() if remote else None)


async def _adopt_then_run(pool: Pool, running: list[Running]) -> None:
    """The pool's loop, once it has taken over what a previous run left it: a first tick before
    that would start instances the adopted ones make unnecessary."""
    if running:
        try:
            await pool.adopt(running)
        except Exception:  # the loop runs regardless: it replaces what could not be adopted
            log.exception("pool %s: adoption failed", pool.spec.deployment)
    await pool.run()
