"""The admin API of cost (`stoker.control.cost`): what each deployment and revision cost, per token, per
request, and how much of it was idle.

GET /admin/v1/cost[?since=DURATION]   {"object": "list", "since_s": 3600 | null, "prices": {...}, "data": [rows]}

`since` is a duration (`90s`, `15m`, `1h`, at most `24h`: the history kept); without it, every
amount since the platform started. Admin-only, as everything under /admin/.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.errors import invalid
from stoker.spec.cost import HISTORY_S
from stoker.spec.durations import parse_duration


def parse_since(value: str | None) -> float | None:
    """Seconds of history asked for; None: since start. A 400 naming `since` for a bad value."""
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise invalid(f"'since': {exc}.", "since") from None
    if not 1 <= seconds <= HISTORY_S:
        raise invalid(
            f"'since' must be at least 1s and at most 24h (the history kept), got {value!r}.", "since"
        )
    return seconds


def cost_routes(platform: Any) -> list[Route]:
    async def cost(request: Request) -> Response:
        unknown = sorted(set(request.query_params) - {"since"})
        if unknown:
            raise invalid(f"Unknown query parameter {unknown[0]!r}; allowed: since.", unknown[0])
        since = parse_since(request.query_params.get("since"))
        meter = platform.cost
        return JSONResponse(
            {
                "object": "list",
                "since_s": since,
                "prices": meter.prices.to_dict(),
                "data": meter.report(since),
            }
        )

    return [Route("/admin/v1/cost", cost, methods=["GET"])]


def cost_paths() -> dict[str, Any]:
    """This route in the API's schema (`stoker.api.openapi`)."""
    error = {"type": "object", "required": ["error"]}
    nullable = {"type": ["number", "null"]}
    row = {
        "type": "object",
        "required": ["deployment", "cost_usd", "cost_per_1k_tokens", "cost_per_1k_requests", "idle_share"],
        "properties": {
            "deployment": {"type": "string"},
            "cost_usd": {"type": "number"},
            "storage_usd": {"type": "number"},
            "requests": {"type": "integer"},
            "tokens_in": {"type": "integer"},
            "tokens_out": {"type": "integer"},
            "cost_per_1k_tokens": nullable,
            "cost_per_1k_requests": nullable,
            "idle_seconds": {"type": "number"},
            "idle_share": nullable,
            "instance_seconds": {"type": "object", "additionalProperties": {"type": "number"}},
            "load_seconds": {"type": "number", "description": "an adapter's loads on its base's instances"},
            "base": {"type": "string", "description": "an adapter's: the deployment it runs on"},
            "base_share_usd": {"type": "number", "description": "an adapter's share of its base's cost"},
            "load_usd": {"type": "number", "description": "an adapter's loads, priced"},
            "adapters_usd": {"type": "number", "description": "a base's: the part charged to its adapters"},
            "revisions": {"type": "array", "items": {"type": "object"}},
        },
    }
    answer = {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "since_s": nullable,
            "prices": {"type": "object"},
            "data": {"type": "array", "items": row},
        },
    }
    since = {
        "name": "since",
        "in": "query",
        "schema": {"type": "string", "pattern": r"^[0-9][0-9a-z.]*$"},
        "description": "a duration, e.g. 15m or 1h, at most 24h (default: since the platform started)",
    }
    return {
        "/admin/v1/cost": {
            "get": {
                "summary": "Cost per deployment and revision: $, $ per 1k tokens and per 1k requests, idle share",
                "parameters": [since],
                "responses": {
                    "200": {
                        "description": "one row per deployment",
                        "content": {"application/json": {"schema": answer}},
                    },
                    "400": {
                        "description": "a bad `since`",
                        "content": {"application/json": {"schema": error}},
                    },
                },
            }
        }
    }
