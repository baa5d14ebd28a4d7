"""`stoker gateway`: the data plane as a process of its own (`run_gateway` wires it from its
options, `build_data_gateway` is its app). OpenAI's routes through each
deployment's activator (`stoker.gateway.plane`), fed by the routing table the controller publishes.

A gateway passes the admin API (`/admin/…`, `/metrics/engines`) through to its controller with the
caller's own `Authorization`, so `STOKER_URL` may name either for the CLI; the controller decides.
It imports nothing of the control plane: no pool, lifecycle or backend
(`tests/platform/gateway/test_imports.py`).
"""

from __future__ import annotations

import contextlib
import logging

import aiohttp
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stoker.api.dashboard import dashboard_routes
from stoker.errors import UNAVAILABLE, APIError
from stoker.gateway.body_budget import BodyBudget
from stoker.gateway.cascade import Cascades
from stoker.gateway.endpoint import data_routes
from stoker.gateway.keys import Access
from stoker.gateway.limits import Limiter
from stoker.gateway.plane import GatewayPlane
from stoker.gateway.request_log import Observer
from stoker.http import openai_exception_handlers, own_hosts, own_origins, read_body
from stoker.serve.common import common_routes, log_setup, middleware_for, observer_of, serve_app
from stoker.serve.options import GatewayOptions
from stoker.spec.keys import NO_LIMITS

log = logging.getLogger("stoker.planes")
MAX_REPORT_BYTES = 8 << 20
# The request headers a gateway passes through to the controller's admin API, and back.
_PASS_REQUEST = ("authorization", "content-type", "origin", "accept")
_PASS_RESPONSE = ("content-type", "retry-after", "cache-control")


def build_data_gateway(
    plane: GatewayPlane,
    *,
    access: Access | None = None,
    observer: Observer | None = None,
    body_memory_bytes: int | None = None,  # request bodies held at once (`stoker.gateway.body_budget`)
) -> Starlette:
    """The data plane's app: OpenAI's routes through the plane's activators; the admin API passed
    through to the controller, but for this gateway's own drift (`observer`: its request log,
    drift and traces, `stoker.gateway.request_log`) and the dashboard's page (its data is the controller's)."""
    limiter = Limiter(
        access.default_limits if access is not None else NO_LIMITS, registry=plane.metrics_registry
    )
    # Cascade routes from the plane's copy of the controller's; never written here (the admin API's
    # `/admin/v1/routes` goes to the controller, as the rest).
    cascades = Cascades(
        plane,
        plane.metrics_registry,
        routes=plane.cascade_routes,
        contexts=plane.cascade_routes.small_context,
    )
    plane.cascade_routes.subscribe(cascades.forget)

    async def admin(request: Request) -> Response:
        return await _pass_through(plane, request)

    async def healthz(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "role": "gateway",
                "deployments": len(plane.list()),
                "controller": "reachable" if plane.controller_reachable else "unreachable",
                # why not, once it failed: a certificate refused says so here
                **({"controller_error": plane.controller_error} if not plane.controller_reachable else {}),
            }
        )

    own = [r for r in common_routes(plane, plane.metrics_registry) if r.path != "/healthz"]
    budget = BodyBudget(body_memory_bytes) if body_memory_bytes is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await plane.start()
        try:
            yield
        finally:
            await plane.shutdown()
            if observer is not None:
                observer.close()

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            *own,
            *data_routes(plane, limiter, cascades, observer, budget=budget),
            *(observer.routes(plane) if observer is not None else []),
            *dashboard_routes(None),
            Route("/metrics/engines", admin, methods=["GET"]),
            Route("/admin/{rest:path}", admin, methods=["GET", "POST", "DELETE"]),
        ],
        exception_handlers=openai_exception_handlers(),
        middleware=middleware_for(access, "gateway", keys=plane.keys),
        lifespan=lifespan,
    )


async def _pass_through(plane: GatewayPlane, request: Request) -> Response:
    """The caller's admin request, as it came, to the controller; its answer streamed back (logs
    may follow)."""
    body = await read_body(request.receive, request.scope, 4 << 20)
    headers = {k: v for k, v in request.headers.items() if k in _PASS_REQUEST}
    url = plane.controller + request.url.path
    session = plane.passthrough_session()
    try:
        upstream = await session.request(
            request.method,
            url,
            params=request.query_params,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None),
        )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise APIError(
            503,
            f"The controller ({plane.controller}) is unreachable: {type(exc).__name__}.",
            type=UNAVAILABLE,
            code="controller_unreachable",
        ) from None

    async def chunks():
        try:
            async for chunk in upstream.content.iter_any():
                yield chunk
        finally:
            upstream.release()

    passed = {k: v for k, v in upstream.headers.items() if k.lower() in _PASS_RESPONSE}
    return StreamingResponse(chunks(), status_code=upstream.status, headers=passed)


def run_gateway(options: GatewayOptions) -> int:
    """`stoker gateway`, wired: the plane fed by the controller's routing table, its activators, the
    keys' synced hashes, this gateway's request log, the app, served until SIGTERM. The exit status."""
    log_setup(options.listen)
    observer = observer_of(options.logging)  # this gateway's request log, drift and traces
    plane = GatewayPlane(
        options.controller,
        options.listen.admin_key,
        options.gateway_id,
        options.holding,
        CollectorRegistry(),
        report_interval_s=options.report_interval_s,
        tls=options.listen.tls,
    )
    observer.register(plane.metrics_registry)
    listen = options.listen
    access = Access(
        listen.admin_key,
        plane.keys,
        own_origins(listen.host, listen.port),
        options.limits,
        own_hosts(listen.host),
    )
    app = build_data_gateway(
        plane, access=access, observer=observer, body_memory_bytes=options.body_memory_bytes
    )
    return serve_app(app, listen)
