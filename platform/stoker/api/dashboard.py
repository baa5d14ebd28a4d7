"""The web dashboard at `/dashboard`: one static page and one script, served by the platform, that
draw the admin API's figures (deployments, the last hour's history, cost where there is a cost API).

    GET /dashboard            the page (HTML)                     open: it holds no data
    GET /dashboard/app.js     its script (hand-written, no build) open: it holds no data
    GET /admin/v1/history     the last hour (`stoker.control.history`)    admin key, as all of /admin/

The page holds no figures and no key: the user pastes the admin key into it (or opens
`/dashboard#key=…`: a fragment never leaves the browser, and the script removes it from the address
bar at once); the key stays in that tab's sessionStorage and goes out only as the bearer header of
the page's own same-origin calls to the admin API. The headers below keep it that way: a script
only from here (no inline script, nothing from elsewhere), calls only to here, no framing, no
referrer, no caching.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.errors import invalid

if TYPE_CHECKING:
    from stoker.control.history import History

OPEN_PATHS = frozenset({"/dashboard", "/dashboard/app.js"})  # served without a key (`keys.KeyAuth`)

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}


def _static(name: str) -> bytes:
    return resources.files("stoker.api").joinpath("static", name).read_bytes()


def dashboard_routes(history: History | None) -> list[Route]:
    """The page and its script; with a `history`, its route too (None: a gateway of its own, which
    serves the page and passes its admin calls, history included, to the controller)."""
    page, script = _static("dashboard.html"), _static("dashboard.js")

    async def dashboard(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def app_js(request: Request) -> Response:
        return Response(script, media_type="text/javascript; charset=utf-8", headers=SECURITY_HEADERS)

    async def get_history(request: Request) -> Response:
        """The points after `since` (epoch seconds), all of the last hour without it."""
        since = request.query_params.get("since")
        try:
            after = float(since) if since is not None else None
        except ValueError:
            raise invalid(f"'since' must be epoch seconds, got {since!r}.", param="since") from None
        return JSONResponse(history.snapshot(after))

    pages = [
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/app.js", app_js, methods=["GET"]),
    ]
    return pages if history is None else [*pages, Route("/admin/v1/history", get_history, methods=["GET"])]


def dashboard_paths() -> dict[str, Any]:
    """These routes in the API's schema (`stoker.api.openapi`)."""
    return {
        "/dashboard": {
            "get": {
                "summary": "The web dashboard's page (no data: it calls the admin API with the key pasted into it)",
                "responses": {"200": {"description": "the page", "content": {"text/html": {}}}},
            }
        },
        "/dashboard/app.js": {
            "get": {
                "summary": "The web dashboard's script",
                "responses": {"200": {"description": "the script", "content": {"text/javascript": {}}}},
            }
        },
        "/admin/v1/history": {
            "get": {
                "summary": "The last hour, one point per interval: each deployment's rates, instances, cold starts",
                "parameters": [
                    {
                        "name": "since",
                        "in": "query",
                        "required": False,
                        "description": "only the points after this time (epoch seconds)",
                        "schema": {"type": "number"},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "interval_s, window_s and the points",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "400": {"description": "`since` is not a number"},
                    "401": {"description": "not the admin key"},
                },
            }
        },
    }
