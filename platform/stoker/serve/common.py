"""What every process shape serves and builds alike: health, its own metrics and the API's schema
(`common_routes`), the middleware stack in front of any route (`middleware_for`), the request log
(`observer_of`), the log's format, and the server (`serve_app`).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.api.dashboard import OPEN_PATHS as DASHBOARD_PATHS
from stoker.api.openapi import openapi_schema
from stoker.gateway.endpoint import Router
from stoker.gateway.keys import OPEN_PATHS, Access, KeyAuth
from stoker.http import AdminGuard, HostGuard, InternalErrors, ServerStopping, make_server, run_server
from stoker.serve.options import Listen, RequestLogging


def common_routes(platform: Router, registry: CollectorRegistry) -> list[Route]:
    """Health, the process's own metrics, the API's schema."""

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "deployments": len(platform.list())})

    schema = openapi_schema()

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


def middleware_for(access: Access | None, component: str, keys: Any = None) -> list[Middleware]:
    """Outermost first: errors become 500s; then auth (no body read before it); then the admin API's
    browser guard. Without `access` everything runs open, as the benchmarks want. `keys` stands in
    for `access.keys` (a gateway's table of key hashes). Without an admin key (open mode) the
    `Host` must be one of the platform's own names for itself, and `/v1/` takes the admin API's
    browser guard too (`stoker.http.HostGuard`, `AdminGuard`): a DNS-rebinding or cross-site page
    can neither read the admin API nor spend the machine's compute."""
    middleware = [Middleware(InternalErrors, component=component)]
    if access is not None and access.admin_key is None:
        middleware.append(Middleware(HostGuard, hosts=access.hosts))
    if access is not None:
        middleware += [
            Middleware(
                KeyAuth,
                admin_key=access.admin_key,
                store=keys if keys is not None else access.keys,
                open_paths=OPEN_PATHS | DASHBOARD_PATHS,  # the dashboard's page; its data is the admin's
                admin_prefixes=("/admin/", "/metrics", "/cluster/"),
            ),
            Middleware(AdminGuard, origins=access.origins),
        ]
    if access is not None and access.admin_key is None:
        middleware.append(
            Middleware(AdminGuard, origins=access.origins, prefix="/v1/", not_json=frozenset({"/v1/files"}))
        )
    return middleware


def observer_of(settings: RequestLogging):
    """The request log, drift and traces (`stoker.gateway.request_log.Observer`) a process keeps; its
    gauges are registered with `Observer.register`."""
    from stoker.gateway.drift import Drift
    from stoker.gateway.request_log import LOG_DIR, Observer, RequestLogFile
    from stoker.paths import data_dir

    file = RequestLogFile(data_dir() / LOG_DIR, settings.max_bytes, settings.files)
    drift = Drift(settings.drift_window_s, settings.drift_min_requests)
    return Observer(file, drift, log_all=settings.log_all, tracing=settings.tracing)


def log_setup(listen: Listen) -> None:
    logging.basicConfig(
        level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def serve_app(app: Starlette, listen: Listen, stopping: ServerStopping | None = None) -> int:
    """Serve `app` until SIGTERM (then drain within the grace period); `stopping`, which the app's
    parts were given, is bound to the server. The process's exit status."""
    server = make_server(
        app,
        host=listen.host,
        port=listen.port,
        log_level=listen.log_level,
        grace_period_s=listen.grace_period_s,
        tls=listen.tls,
    )
    if stopping is not None:
        stopping.bind(server)
    return 0 if run_server(server) else 1
