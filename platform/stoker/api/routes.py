"""The admin API of cascade routes (`stoker.gateway.cascade`): `GET/POST /admin/v1/routes`,
`GET/DELETE /admin/v1/routes/{name}`, all JSON, admin-only (under `/admin/`, as every admin route).

A POST creates a route (201) or replaces one of that name (200). Refused, in OpenAI's error shape:
a bad field (400 naming it; `small` and `large` must be deployed now), a name a deployment has
(409 `name_taken`: clients send both as `model`, so one name means one thing). A route whose
deployment is removed later stays, and answers 503 until it is deployed again.

These routes run where the routes are owned: `stoker up`, or `stoker controller`, whose
`on_change` bumps the routing table so that gateways learn of a change at once (a gateway passes
these calls through to its controller).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.errors import APIError, invalid
from stoker.gateway.cascade import Cascades
from stoker.http import parse_json_object, read_body
from stoker.spec.routes import CascadeRoute, route_not_found, validate_route

MAX_BODY_BYTES = 64 << 10  # a route is five short fields


def cascade_routes(
    platform: Any, cascades: Cascades, on_change: Callable[[], None] | None = None
) -> list[Route]:
    def changed() -> None:
        if on_change is not None:
            on_change()

    def describe(route: CascadeRoute) -> dict[str, Any]:
        counts = cascades.counts.get(route.name)  # since this process started
        missing = [n for n in (route.small, route.large) if platform.get(n) is None]
        return {**route.to_dict(), "requests": counts or {}, "missing": missing}

    async def list_routes(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [describe(r) for r in cascades.table.all()]})

    async def create_route(request: Request) -> Response:
        body = parse_json_object(await read_body(request.receive, request.scope, MAX_BODY_BYTES))
        route = validate_route(body)
        if platform.get(route.name) is not None:
            raise APIError(
                409,
                f"{route.name!r} is a deployment's name; a route needs a name of its own.",
                param="name",
                code="name_taken",
            )
        for field in ("small", "large"):
            if platform.get(getattr(route, field)) is None:
                raise invalid(f"'{field}': no deployment named {getattr(route, field)!r}.", field)
        created = await cascades.table.put(route)
        changed()
        return JSONResponse(describe(route), status_code=201 if created else 200)

    async def get_route(request: Request) -> Response:
        route = cascades.table.get(request.path_params["name"])
        if route is None:
            raise route_not_found(request.path_params["name"])
        return JSONResponse(describe(route))

    async def delete_route(request: Request) -> Response:
        route = await cascades.table.delete(request.path_params["name"])
        cascades.forget(route.name)
        changed()
        return JSONResponse({"name": route.name, "deleted": True})

    return [
        Route("/admin/v1/routes", list_routes, methods=["GET"]),
        Route("/admin/v1/routes", create_route, methods=["POST"]),
        Route("/admin/v1/routes/{name}", get_route, methods=["GET"]),
        Route("/admin/v1/routes/{name}", delete_route, methods=["DELETE"]),
    ]
