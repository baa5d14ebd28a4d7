"""`stoker up`: both planes in one process. `build_gateway` is its app: OpenAI's routes
(`stoker.gateway.endpoint`), the admin API (`stoker.api`), health, metrics and the schema, behind
the keys' middleware; `run_up` wires the process from its options (`stoker.serve.options`).
"""

from __future__ import annotations

import contextlib
import logging

from starlette.applications import Starlette

from stoker.api.cost import cost_routes
from stoker.api.dashboard import dashboard_routes
from stoker.api.deployments import admin_routes
from stoker.api.routes import cascade_routes
from stoker.batch.config import BatchConfig
from stoker.batch.routes import batch_routes
from stoker.batch.service import Batches
from stoker.control.history import HistoryConfig, HistorySampler
from stoker.control.platform import Platform
from stoker.control.routes import owned_cascades
from stoker.gateway.body_budget import BodyBudget
from stoker.gateway.endpoint import InferenceEndpoint, data_routes
from stoker.gateway.keys import Access
from stoker.gateway.limits import Limiter
from stoker.gateway.request_log import Observer
from stoker.http import ServerStopping, openai_exception_handlers
from stoker.node.gpu_metrics import register_gpu_metrics
from stoker.paths import data_dir, lock_data_dir
from stoker.serve.common import common_routes, log_setup, middleware_for, observer_of, serve_app
from stoker.serve.control_plane import access_of, checkpoints_of, platform_of
from stoker.serve.options import UpOptions
from stoker.spec.keys import ADMIN, NO_LIMITS, Principal

log = logging.getLogger("stoker.gateway")


def build_gateway(
    platform: Platform,
    *,
    access: Access | None = None,  # None: no keys at all, everyone is the admin (benchmarks)
    observer: Observer | None = None,  # the request log, drift and traces (`stoker.gateway.request_log`)
    checkpoint_interval_s: float | None = None,  # None: nothing checkpointed (`stoker.control.checkpoint`)
    batch: BatchConfig | None = None,  # the batch API's settings (`stoker.batch.config`); None: defaults
    body_memory_bytes: int | None = None,  # request bodies held at once (`stoker.gateway.body_budget`)
) -> Starlette:
    """Both planes in one process (`stoker up`): OpenAI's routes, the batch API, the admin API, the
    pools."""
    limiter = Limiter(
        access.default_limits if access is not None else NO_LIMITS, registry=platform.metrics_registry
    )
    cascades = owned_cascades(platform)  # cascade routes (`stoker.gateway.cascade`)
    # The last hour for /dashboard (`stoker.control.history`); the GPUs' own figures where NVML sees any.
    sampler = HistorySampler(platform.metrics_registry, HistoryConfig.from_env())
    register_gpu_metrics(platform.metrics_registry)
    # Cost, that hour and the policies' learned states, kept in the data dir across a restart.
    checkpoints = checkpoints_of(platform, sampler, checkpoint_interval_s)
    budget = BodyBudget(body_memory_bytes) if body_memory_bytes is not None else None
    inference = InferenceEndpoint(platform, limiter, cascades, observer, budget)
    # Files and batches (`stoker.batch`): each line sent through `inference`, as a client's would be.
    batches = Batches(batch or BatchConfig())
    routes = [
        *data_routes(platform, limiter, cascades, observer, inference),
        *batch_routes(batches.files, batches.runner, batches.config),
        *common_routes(platform, platform.metrics_registry),
        *admin_routes(platform, access, limiter, cascades.conflict),
        *cascade_routes(platform, cascades),
        *cost_routes(platform),
        *dashboard_routes(sampler.history),
        *(observer.routes(platform) if observer is not None else []),
    ]
    middleware = middleware_for(access, "gateway")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if checkpoints is not None:
            await checkpoints.restore()  # before the pools exist: each takes its policy's state as it is made
        await platform.start()
        sampler.start()
        if checkpoints is not None:
            checkpoints.start()
        await batches.start(
            platform.data_dir, inference, platform, _principals(access), platform.metrics_registry
        )
        try:
            yield
        finally:
            await batches.stop()  # its lines in flight are sent again after a restart
            if checkpoints is not None:
                await checkpoints.stop()
            await sampler.stop()
            await platform.shutdown()
            if checkpoints is not None:  # once drained: the last seconds count
                sampler.sample()
                await checkpoints.write()
            cascades.close()
            if observer is not None:
                observer.close()
            if access is not None:
                access.keys.close()

    return Starlette(
        routes=routes,
        exception_handlers=openai_exception_handlers(),
        middleware=middleware,
        lifespan=lifespan,
    )


def _principals(access: Access | None):
    """A batch's key, by id, as the caller its lines are sent as: None once it is revoked."""

    def principal_for(key_id: str) -> Principal | None:
        if key_id == ADMIN.key_id or access is None:
            return ADMIN
        return next((r.principal for r in access.keys.all() if r.id == key_id), None)

    return principal_for


def run_up(options: UpOptions) -> int:
    """`stoker up`, wired: the platform with its activators, the keys, the request log, the app,
    served until SIGTERM. The exit status. Refused, before anything is touched, while another
    platform holds the data dir (`stoker.paths.lock_data_dir`)."""
    lock_data_dir(data_dir(), "stoker up")  # held until this process ends
    log_setup(options.listen)
    observer = observer_of(options.logging)
    stopping = ServerStopping()
    tls = options.listen.tls  # engines serve its certificate, verified by its CA (`stoker.tls`)
    platform = platform_of(
        options.platform,
        activator_config=options.holding,
        stopping=stopping,
        engine_tls=tls.engine_tls() if tls is not None else None,
    )
    observer.register(platform.metrics_registry)
    app = build_gateway(
        platform,
        access=access_of(options.listen, options.limits),
        observer=observer,
        checkpoint_interval_s=options.platform.checkpoint_interval_s,
        batch=options.batch,
        body_memory_bytes=options.body_memory_bytes,
    )
    return serve_app(app, options.listen, stopping)
