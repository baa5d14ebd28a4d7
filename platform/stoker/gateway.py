"""The gateway: OpenAI's routes by deployment name, the admin API, health and metrics.

The request path is pure ASGI (no `BaseHTTPMiddleware`, nothing that buffers): the gateway reads
the body (bounded), looks at `model` and `stream`, and hands the request to that deployment's
activator, which streams the answer through. No timeout here cuts a long generation. `ERRORS` is
the one table from the activator's errors to HTTP statuses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from activator import ActivatorError, DeadlineExceeded, QueueFull, Unavailable, UpstreamError
from stoker.http import ClientGone, InternalErrors, openai_exception_handlers, parse_json_object, read_body
from stoker.openai_errors import (
    SERVER_ERROR,
    UNAVAILABLE,
    APIError,
    error_response,
    invalid,
)
from stoker.openapi import openapi_schema
from stoker.platform import Platform
from stoker.registry import not_found

log = logging.getLogger("stoker.gateway")

MAX_BODY_BYTES = 4 << 20

# The activator's errors as the client sees them: (status, OpenAI error type).
ERRORS: dict[type[ActivatorError], tuple[int, str]] = {
    QueueFull: (503, UNAVAILABLE),
    DeadlineExceeded: (503, UNAVAILABLE),
    Unavailable: (503, UNAVAILABLE),
    UpstreamError: (502, SERVER_ERROR),
}


def api_error(exc: ActivatorError) -> APIError:
    status, kind = next((v for cls, v in ERRORS.items() if isinstance(exc, cls)), (500, SERVER_ERROR))
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    return APIError(status, str(exc), type=kind, code=exc.code, headers=headers)


class InferenceEndpoint:
    """`POST /v1/chat/completions` and `POST /v1/completions`, routed by the body's `model`."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(receive, scope, MAX_BODY_BYTES)
            name, stream = _route_fields(body)
            deployment = self.platform.get(name)
            if deployment is None:
                raise APIError(
                    404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
                )
            await deployment.activator.serve(scope, receive, send, body, stream)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
        except ActivatorError as exc:
            await error_response(api_error(exc))(scope, receive, send)
        except ClientGone:
            return


def _route_fields(body: bytes) -> tuple[str, bool]:
    parsed = parse_json_object(body)
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string.", param="model")
    stream = parsed.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"'stream' must be a boolean, got {stream!r}.", param="stream")
    return model, stream


def build_gateway(platform: Platform, *, on_shutdown: Callable[[], object] | None = None) -> Starlette:
    async def models(request: Request) -> Response:
        cards = [
            {
                "id": d.spec.name,
                "object": "model",
                "created": 0,
                "owned_by": "stoker",
                "root": d.spec.snapshot_id,
            }
            for d in platform.list()
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "deployments": len(platform.list())})

    schema = openapi_schema()

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(platform.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    def describe(d) -> dict:
        decision = d.pool.last_decision
        last = None
        if decision is not None:
            last = {
                "ready": decision.ready,
                "sleeping": decision.sleeping,
                "reason": decision.reason,
                "forecast": decision.forecast,
            }
        return {**d.spec.to_dict(), "instances": d.pool.counts(), "decision": last}

    async def list_deployments(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [describe(d) for d in platform.list()]})

    async def create_deployment(request: Request) -> Response:
        body = parse_json_object(await read_body(request.receive, request.scope, MAX_BODY_BYTES))
        spec, created = await platform.deploy(body)
        return JSONResponse(describe(platform.get(spec.name)), status_code=201 if created else 200)

    async def get_deployment(request: Request) -> Response:
        d = platform.get(request.path_params["name"])
        if d is None:
            raise not_found(request.path_params["name"])
        return JSONResponse(describe(d))

    async def delete_deployment(request: Request) -> Response:
        spec = await platform.remove(request.path_params["name"])
        return JSONResponse({"name": spec.name, "deleted": True})

    inference = InferenceEndpoint(platform)
    routes = [
        Route("/v1/chat/completions", inference, methods=["POST"]),
        Route("/v1/completions", inference, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/admin/v1/deployments", list_deployments, methods=["GET"]),
        Route("/admin/v1/deployments", create_deployment, methods=["POST"]),
        Route("/admin/v1/deployments/{name}", get_deployment, methods=["GET"]),
        Route("/admin/v1/deployments/{name}", delete_deployment, methods=["DELETE"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await platform.start()
        try:
            yield
        finally:
            await platform.shutdown()

    return Starlette(
        routes=routes,
        exception_handlers=openai_exception_handlers(),
        middleware=[Middleware(InternalErrors, component="gateway")],
        lifespan=lifespan,
    )
