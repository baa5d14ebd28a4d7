"""`stoker controller`: the control plane as a process of its own (`run_controller` wires it from
its options, `build_controller` is its app). The registry, pools, policies and
the backend; the admin API; what gateways learn (`routing_table`, long-polled) and what they report
(`stoker.control.cluster`). `stoker up` runs both planes in one process (`stoker.serve.up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.api.cost import cost_routes
from stoker.api.dashboard import dashboard_routes
from stoker.api.deployments import admin_routes
from stoker.api.routes import cascade_routes
from stoker.control.checkpoint import CheckpointStore
from stoker.control.history import HistoryConfig, HistorySampler
from stoker.control.kube.keys import SecretKeyStore
from stoker.control.kube.reconcile import Reconciler
from stoker.control.kube.registry import ResourceRegistry
from stoker.control.kube.routes import ResourceRoutes
from stoker.control.platform import Platform
from stoker.control.routes import owned_cascades
from stoker.errors import invalid
from stoker.gateway.cascade import Cascades, RouteTable
from stoker.gateway.keys import Access
from stoker.gateway.limits import Limiter
from stoker.gateway.metering import GatewaySeries, parse_series
from stoker.http import ServerStopping, openai_exception_handlers, parse_json_object, read_body
from stoker.node.gpu_metrics import register_gpu_metrics
from stoker.paths import data_dir, lock_data_dir
from stoker.serve.common import common_routes, log_setup, middleware_for, serve_app
from stoker.serve.control_plane import access_of, checkpoints_of, platform_of
from stoker.serve.options import ControllerOptions, KubeSettings
from stoker.spec.keys import NO_LIMITS
from stoker.spec.planes import parse_gateway_id, parse_report, share

log = logging.getLogger("stoker.planes")
MAX_REPORT_BYTES = 8 << 20
SYNC_TIMEOUT_S = 60.0  # for the first list of the resources (a standby lists them too)
# The request headers a gateway passes through to the controller's admin API, and back.
_PASS_REQUEST = ("authorization", "content-type", "origin", "accept")
_PASS_RESPONSE = ("content-type", "retry-after", "cache-control")


def routing_table(
    platform: Platform, access: Access | None, gateway: str, cascades: Cascades | None = None
) -> dict[str, Any]:
    """What one gateway routes by: every deployment's traffic split and, per revision, its READY
    endpoints with their keys and this gateway's share of each one's concurrency, and why it
    cannot start (if so); the tenant keys' hashes; and the cascade routes, each with its small
    deployment's context for the gateway's pre-check (`stoker.gateway.routes.SyncedRoutes`)."""
    gateways = platform.routes.live()
    if gateway not in gateways:
        gateways = sorted([*gateways, gateway])
    deployments = {}
    for d in platform.list():
        units = {}
        for revision, unit in d.units.items():
            endpoints = [
                {
                    "id": inst.id,
                    "url": inst.url,
                    "key": inst.secret,
                    "max_concurrency": share(inst.max_concurrency, gateways, gateway),
                }
                for inst in unit.pool.endpoints()
            ]
            units[str(revision)] = {
                "snapshot_id": unit.spec.snapshot_id,
                "unavailable": unit.demand.unavailable if unit.demand is not None else None,
                "balance": unit.spec.balance,  # how the gateway picks among them (`activator.affinity`)
                "affinity_bound": unit.spec.affinity_bound,
                # whether its engines take a body's `priority` (`Activator.set_engine_priority`)
                "engine_priority": unit.spec.engine_settings.takes_priority(unit.spec.engine),
                "log_requests": unit.spec.log_requests,  # the gateway's request log
                "log_content": unit.spec.log_content,
                # how long the start a held request waits on should take: the gateway holds it
                # that long and more (`activator.Activator._hold_for`), as the pool's own would
                "expected_start_s": unit.pool.expected_start_s(),
                "endpoints": endpoints,
            }
        deployments[d.name] = {
            "snapshot_id": d.spec.snapshot_id,
            "revision": d.spec.revision,
            "traffic": {str(r): p for r, p in d.traffic.items()},
            "units": units,  # one per revision that serves, warms or drains, with its READY endpoints
        }
    keys = access.keys.hashed() if access is not None else []
    routes = cascades.table.all() if cascades is not None else []
    return {
        "epoch": platform.routes.epoch,
        "version": platform.routes.version,
        "gateways": len(gateways),
        "deployments": deployments,
        "keys": keys,
        "cascades": [{**r.to_dict(), "small_context": cascades.small_context(r)} for r in routes],
        # LoRA adapter deployments, served on their bases' activators (`stoker.gateway.adapters`)
        "adapters": {a.name: a.routed() for a in platform.adapters.list()},
    }


def build_controller(
    platform: Platform,
    *,
    access: Access | None = None,
    poll_timeout_s: float = 20.0,
    leave_instances: bool = True,
    leader: Any = None,  # a `stoker.control.leader.LeaderElector`: act only while holding its Lease
    on_lost_lease: Callable[[], object] | None = None,
    checkpoint_interval_s: float | None = None,  # None: nothing checkpointed (`stoker.control.checkpoint`)
    checkpoint_store: CheckpointStore | None = None,  # None: files in the data dir
    route_table: RouteTable | None = None,  # None: SQLite in the data dir; on a cluster, StokerRoutes
) -> Starlette:
    """The control plane's app: the admin API, and the cluster API gateways and node agents use.

    With a `leader`, the app starts nothing before it holds the Lease (a standby serves nothing,
    so the Service sends gateways to the leader only), and on losing it calls `on_lost_lease`
    (the process exits) leaving every instance to the next leader, whatever `leave_instances`."""
    limiter = Limiter(NO_LIMITS, registry=platform.metrics_registry)  # keys are revoked here too
    # The cascade routes are owned here and served by the gateways, from the routing table.
    cascades = owned_cascades(platform, route_table)  # cascade routes (`stoker.gateway.cascade`)
    register_gpu_metrics(platform.metrics_registry)  # the local backend's GPUs, where NVML sees any
    # The dashboard's last hour: the pools' figures from here, the requests' from the gateways.
    gateway_series = GatewaySeries()
    sampler = HistorySampler(
        platform.metrics_registry,
        HistoryConfig.from_env(),
        extra=lambda: gateway_series.reading(platform.routes.live()),
    )
    checkpoints = checkpoints_of(platform, sampler, checkpoint_interval_s, checkpoint_store)
    # On a cluster the deployments are resources: watched (by a standby too) and reconciled.
    resources = platform.registry if isinstance(platform.registry, ResourceRegistry) else None
    # ... and so are the tenant keys (Secrets) and the cascade routes (StokerRoutes): what the
    # API server holds, mirrored here, a standby's copies warm too.
    keys = access.keys if access is not None else None
    mirrored = [
        s
        for s in (resources, keys, route_table)
        if isinstance(s, ResourceRegistry | SecretKeyStore | ResourceRoutes)
    ]
    reconciler = None
    if resources is not None:
        reconciler = Reconciler(platform, resources, name_taken=cascades.conflict)
        resources.bind(reconciler.changed, reconciler.traffic_changed)

    async def routes(request: Request) -> Response:
        gateway = parse_gateway_id(request.query_params.get("gateway"))
        try:
            after = int(request.query_params.get("after", "-1"))
        except ValueError:
            raise invalid("'after' must be an integer.", "after") from None
        platform.routes.seen(gateway)
        epoch, waited = request.query_params.get("epoch"), 0.0
        # In slices: a controller shutting down answers at once, rather than holding its drain
        # until every gateway's poll times out.
        while waited < poll_timeout_s and not platform.stopping():
            if await platform.routes.wait(epoch, after, min(1.0, poll_timeout_s - waited)):
                break
            waited += 1.0
        return JSONResponse(routing_table(platform, access, gateway, cascades))

    async def load(request: Request) -> Response:
        body = parse_json_object(await read_body(request.receive, request.scope, MAX_REPORT_BYTES))
        gateway, reports = parse_report(body)
        series = parse_series(body.get("series"))
        platform.routes.seen(gateway)
        now, live, busy = platform.clock(), frozenset(platform.routes.live()), {}
        for key, report in reports.items():
            name, _, revision = key.rpartition("@")
            d = platform.get(name)
            unit = d.units.get(int(revision)) if d is not None else None
            if unit is not None and unit.demand is not None:  # one gone meanwhile: its news is moot
                # Only this base's adapters are forecast on its pool: a crafted or stale name would
                # take the place of a real one among the adapters its policy tracks.
                served = set(platform.adapters.on(name))
                report["adapters"] = [a for a in report["adapters"] if a in served]
                unit.demand.report(gateway, report, now)
                for status, ttft_s in report["answers"]:  # for the canary check; counted there
                    d.stats.record(int(revision), status, ttft_s, count=False)
                for wall, tokens_in, tokens_out, status, *adapter in report["usage"]:  # `.gateway.metering`
                    by, rev = adapter if adapter else (name, int(revision))
                    if not adapter or platform.adapters.has_revision(by, rev):  # else stale, or crafted
                        platform.cost.record(by, rev, wall, tokens_in, tokens_out, status)
                for engine_name, seconds in report["loads"]:
                    platform.adapters.loaded(engine_name, seconds)
                    unit.pool.adapter_loaded(seconds)  # the adapter tier, learned from every load
                busy[name] = busy.get(name, 0) + report["in_flight"] + report["queued"]
        for name, n in busy.items():
            platform.cost.remote_in_flight(name, gateway, n, live)
        gateway_series.update(gateway, series)
        return JSONResponse({"version": platform.routes.version})

    async def snapshots(request: Request) -> Response:
        """Which snapshots the deployments use, for the node agents (`stoker node`)."""
        by_id: dict[str, dict[str, Any]] = {}
        for d in [*platform.list(), *platform.adapters.list()]:  # an adapter's files too
            uri = d.spec.model if d.spec.model.startswith("s3://") else None
            entry = by_id.setdefault(
                d.spec.snapshot_id, {"id": d.spec.snapshot_id, "uri": uri, "deployments": []}
            )
            entry["deployments"].append(d.spec.name)
        return JSONResponse({"snapshots": list(by_id.values())})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": "controller", "deployments": len(platform.list())})

    cluster = [
        Route("/cluster/v1/routes", routes, methods=["GET"]),
        Route("/cluster/v1/load", load, methods=["POST"]),
        Route("/cluster/v1/snapshots", snapshots, methods=["GET"]),
    ]
    own = [r for r in common_routes(platform, platform.metrics_registry) if r.path != "/healthz"]

    lost: list[bool] = []

    async def lead() -> None:
        await asyncio.Event().wait()  # leads until cancelled by the elector

    async def step_down() -> None:
        log.error("lost the lease %s: stopping, instances left to the next leader", leader.name)
        lost.append(True)
        if on_lost_lease is not None:
            on_lost_lease()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        election = None
        for store in mirrored:
            store.start()  # the standby's watches are warm when it takes over
        for store in mirrored:
            await store.wait_synced(SYNC_TIMEOUT_S)
        if resources is not None:
            log.info("watching %d deployment resource(s)", len(resources.deployments.objects))
        if leader is not None:
            election = asyncio.create_task(leader.run(lead, step_down), name="leader-election")
            log.info("waiting for the lease %s as %s", leader.name, leader.identity)
            while not leader.is_leader:
                if election.done():
                    election.result()  # raises what ended it
                    raise RuntimeError(f"the election for {leader.name} ended before this replica led")
                await asyncio.sleep(0.1)
            log.info("leading (lease %s)", leader.name)
        if checkpoints is not None:
            await checkpoints.restore()  # before the pools exist: each takes its policy's state as it is made
        await platform.start()
        if reconciler is not None:
            reconciler.start()
        sampler.start()
        if checkpoints is not None:
            checkpoints.start()
        try:
            yield
        finally:
            if checkpoints is not None:
                await checkpoints.stop()
            await sampler.stop()
            if reconciler is not None:
                await reconciler.stop()
            await platform.shutdown(stop_instances=not leave_instances and not lost)
            if checkpoints is not None:  # once drained: the last seconds count
                sampler.sample()
                await checkpoints.write()
            cascades.close()
            for store in mirrored:
                await store.aclose()
            if election is not None:
                election.cancel()  # releases the lease: the next replica need not wait it out
                await asyncio.gather(election, return_exceptions=True)
            if access is not None:
                access.keys.close()

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            *own,
            *cluster,
            *admin_routes(platform, access, limiter, cascades.conflict),
            *cascade_routes(platform, cascades, on_change=platform.routes.bump),
            *cost_routes(platform),
            *dashboard_routes(sampler.history),
        ],
        exception_handlers=openai_exception_handlers(),
        middleware=middleware_for(access, "controller"),
        lifespan=lifespan,
    )


def run_controller(options: ControllerOptions) -> int:
    """`stoker controller`, wired: the platform (on the Kubernetes backend, with its Lease election,
    where `options.kube` says), the keys, the app, served until SIGTERM or until the Lease is lost.
    The exit status. A setting the backend refuses, a namespace that does not admit engine pods
    included, raises `warm_pool.errors.InvalidConfig` before anything is served. Refused while
    another platform holds the data dir (`stoker.paths.lock_data_dir`)."""
    lock_data_dir(data_dir(), "stoker controller")  # held until this process ends
    log_setup(options.listen)
    tls = options.listen.tls
    # Engines serve this process's certificate (or, in pods, the Secret's), verified by its CA.
    engine_tls = tls.engine_tls() if tls is not None else None
    wiring, leader, checkpoint_store, settings, client = {}, None, None, options.platform, None
    if options.kube is not None:
        asyncio.run(_check_namespace(options.kube, tls))
        wiring, leader, checkpoint_store, client = _kubernetes(options.kube, tls)
        # vLLM runs in the engine pods, each asking its image's own: none is looked for here.
        settings = replace(settings, vllm=replace(settings.vllm, in_image=True))
    stopping = ServerStopping()
    platform = platform_of(
        settings,
        controller=True,
        gateway_stale_after_s=options.gateway_stale_after_s,
        gateway_silent_grace_s=options.gateway_silent_grace_s,
        stopping=stopping,
        **({"engine_tls": engine_tls} | wiring),
    )
    keys, route_table = None, None
    if client is not None:  # the tenant keys and the cascade routes in the API server; a change
        # to either, someone's `kubectl apply` too, wakes the gateways' long polls
        bump = platform.routes.bump
        keys = SecretKeyStore(client, options.kube.namespace, on_change=bump)
        route_table = ResourceRoutes(client, options.kube.namespace, on_change=bump)
    app = build_controller(
        platform,
        access=access_of(options.listen, NO_LIMITS, keys),
        route_table=route_table,
        leave_instances=options.leave_instances,
        leader=leader,
        on_lost_lease=stopping.stop,  # the process exits; the next leader adopts the instances
        checkpoint_interval_s=settings.checkpoint_interval_s,
        checkpoint_store=checkpoint_store,
    )
    return serve_app(app, options.listen, stopping)


def _backend(kube: KubeSettings, client_or_config: Any, tls: Any = None) -> Any:
    from warm_pool.backends.kube import KubeBackend
    from warm_pool.engine_tls import MOUNT_DIR

    return KubeBackend(
        client_or_config,
        kube.namespace,
        image=kube.image,
        store_path=kube.store_path,
        owner=kube.owner,
        pull_env=kube.pull_env,
        pull_secret=kube.pull_secret,
        engine_tls=tls.engine_tls(MOUNT_DIR, kube.engine_tls_secret) if kube.engine_tls_secret else None,
    )


async def _check_namespace(kube: KubeSettings, tls: Any = None) -> None:
    """InvalidConfig, before anything starts, if the namespace refuses engine pods (Pod Security:
    each mounts the node's store, a hostPath). With a client of its own: the server's loop is not
    running yet."""
    backend = _backend(kube, kube.config, tls)
    try:
        await backend.check_admission()
    finally:
        await backend.aclose()


def _kubernetes(kube: KubeSettings, tls: Any = None) -> tuple[dict[str, Any], Any, CheckpointStore, Any]:
    """The Kubernetes backend with its pods' GPUs and the deployments' resources, the Lease
    election, the checkpoints' ConfigMaps in the namespace (the controller has no volume; its sync
    client connects at the first checkpoint, in the threads `Checkpoints` reads and writes in), and
    the client the keys' and routes' stores share."""
    from lightkube import AsyncClient

    from stoker.control.kube.checkpoints import ConfigMapCheckpointStore
    from stoker.control.leader import LeaderElector
    from warm_pool.backends.kube import PodGpus

    client = AsyncClient(config=kube.config, namespace=kube.namespace)
    backend = _backend(kube, client, tls)
    leader = LeaderElector(
        client, kube.namespace, kube.lease_name, kube.identity, lease_s=kube.lease_s, renew_s=kube.lease_s / 3
    )
    registry = ResourceRegistry(client, kube.namespace)
    checkpoints = ConfigMapCheckpointStore(kube.config, kube.namespace)
    wiring = {"backend": backend, "gpus": PodGpus(), "registry": registry, "engine_tls": backend.engine_tls}
    return wiring, leader, checkpoints, client
