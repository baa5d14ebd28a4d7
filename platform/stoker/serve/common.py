"""What every process shape serves alike: health, its own metrics and the API's schema
(`common_routes`), and the middleware stack in front of any route (`middleware_for`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.api.dashboard import OPEN_PATHS as DASHBOARD_PATHS
from stoker.api.openapi import openapi_schema
from stoker.gateway.endpoint import Router
from stoker.gateway.keys import OPEN_PATHS, Access, KeyAuth
from stoker.http import (
    AdminGuard,
    InternalErrors,
)


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
    for `access.keys` (a gateway's table of key hashes)."""
    middleware = [Middleware(InternalErrors, component=component)]
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
    return middleware
