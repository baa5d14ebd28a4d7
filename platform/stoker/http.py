"""Small pure-ASGI helpers shared by the gateway and the CPU engine."""

from __future__ import annotations

import json
import logging
import signal

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from stoker.openai_errors import INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, APIError, error_response, invalid

log = logging.getLogger("stoker.http")


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(receive: Receive, scope: Scope, limit: int) -> bytes:
    """The whole request body, refusing (413) anything over `limit` bytes without reading it all."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object, or a 400 in OpenAI's shape."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    return body


def openai_exception_handlers(component: str) -> dict:
    """Starlette exception handlers that answer routing errors and crashes in OpenAI's error shape."""

    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, type=kind))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"Internal error in the {component}.", type=SERVER_ERROR))

    return {APIError: api_error, HTTPException: http_error, Exception: server_error}


def make_server(app, *, host: str, port: int, log_level: str, grace_period_s: float):
    """A uvicorn server for `app`: no access log, in-flight requests get `grace_period_s` on SIGTERM."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=grace_period_s,
        timeout_keep_alive=30,
    )
    return uvicorn.Server(config)


def run_server(server) -> bool:
    """Serve until SIGTERM or Ctrl-C; False if the server could not start (port taken).

    uvicorn drains on SIGTERM (stops accepting, waits up to the grace period for requests in
    flight), then re-raises the signal under the handler it found at start, so the process would
    die by the signal. Finding SIGTERM ignored makes a drained stop exit 0.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server.run()
    return server.started
