"""The admin API of revisions: list them, split the traffic, roll back (`stoker.control.rollout`).

GET  /admin/v1/deployments/{name}/revisions   every revision, its traffic share and state
PUT  /admin/v1/deployments/{name}/traffic     {"traffic": {"3": 10, "2": 90}}
POST /admin/v1/deployments/{name}/rollback    {"to": 2} (optional: the revision before the primary)
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.errors import invalid
from stoker.http import parse_json_object, read_body

MAX_BODY_BYTES = 64 << 10


def revision_routes(platform: Any) -> list[Route]:
    async def revisions(request: Request) -> Response:
        rows = platform.revisions(request.path_params["name"])
        return JSONResponse({"object": "list", "data": rows})

    async def traffic(request: Request) -> Response:
        body = await _body(request, {"traffic"})
        if "traffic" not in body:
            raise invalid("'traffic' is required: an object of revision: percent.", "traffic")
        name = request.path_params["name"]
        d = await platform.set_traffic(name, body["traffic"])
        return JSONResponse({"name": name, "traffic": _traffic(d), "revisions": platform.revisions(name)})

    async def rollback(request: Request) -> Response:
        body = await _body(request, {"to"})
        name = request.path_params["name"]
        target = await platform.rollback(name, body.get("to"))
        return JSONResponse(
            {"name": name, "revision": target.revision, "snapshot_id": target.snapshot_id}
            | {"revisions": platform.revisions(name)}
        )

    return [
        Route("/admin/v1/deployments/{name}/revisions", revisions, methods=["GET"]),
        Route("/admin/v1/deployments/{name}/traffic", traffic, methods=["PUT"]),
        Route("/admin/v1/deployments/{name}/rollback", rollback, methods=["POST"]),
    ]


async def _body(request: Request, allowed: set[str]) -> dict[str, Any]:
    raw = await read_body(request.receive, request.scope, MAX_BODY_BYTES)
    body = parse_json_object(raw) if raw.strip() else {}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"Unknown field(s) {unknown}; allowed: {', '.join(sorted(allowed))}.", unknown[0])
    return body


def _traffic(d: Any) -> dict[str, int]:
    return {str(r): p for r, p in sorted(d.traffic.items())}


def revision_paths(name_param: list[dict[str, Any]]) -> dict[str, Any]:
    """These routes in the API's schema (`stoker.api.openapi`)."""

    def body(schema: dict[str, Any]) -> dict[str, Any]:
        return {"content": {"application/json": {"schema": schema}}}

    def errors(*codes: int) -> dict[str, Any]:
        error = {"type": "object", "required": ["error"]}
        return {str(c): {"description": "an error, in OpenAI's shape", **body(error)} for c in codes}

    listing = {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array"}}}
    moved = {"type": "object", "properties": {"name": {"type": "string"}, "revisions": {"type": "array"}}}
    traffic = {
        "type": "object",
        "required": ["traffic"],
        "additionalProperties": False,
        "properties": {
            "traffic": {
                "type": "object",
                "description": "revision number -> whole percent; the percents sum to 100",
                "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        },
    }
    rollback = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"to": {"type": "integer", "minimum": 1, "description": "default: the one before"}},
    }
    return {
        "/admin/v1/deployments/{name}/revisions": {
            "get": {
                "summary": "Every revision of a deployment: snapshot, settings, traffic share, state",
                "parameters": name_param,
                "responses": {"200": {"description": "oldest first", **body(listing)}, **errors(404)},
            }
        },
        "/admin/v1/deployments/{name}/traffic": {
            "put": {
                "summary": "Split the traffic between revisions (one user, one revision)",
                "parameters": name_param,
                "requestBody": {"required": True, **body(traffic)},
                "responses": {
                    "200": {"description": "in force", **body(moved)},
                    **errors(400, 404, 409, 413),
                },
            }
        },
        "/admin/v1/deployments/{name}/rollback": {
            "post": {
                "summary": "Back to an earlier revision's snapshot and settings, warm before the switch",
                "parameters": name_param,
                "requestBody": {"required": False, **body(rollback)},
                "responses": {
                    "200": {"description": "under way", **body(moved)},
                    **errors(400, 404, 409, 413),
                },
            }
        },
    }
