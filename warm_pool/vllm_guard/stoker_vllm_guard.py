"""Stoker's guard in front of every route of a vLLM instance: loaded by vLLM itself, inside its API
server, as `vllm serve --middleware stoker_vllm_guard.EngineGuard`.

vLLM's own key (`VLLM_API_KEY`) guards only its `/v1` routes (and `/v2`, `/inference`, `/cohere`).
Sleep mode needs vLLM's dev mode (`VLLM_SERVER_DEV_MODE=1`), and dev mode also serves, to anyone who
can reach the port, `POST /collective_rpc` (any method of every worker), `/sleep`, `/wake_up`,
`/reset_prefix_cache`, `/pause`, `/update_weights` and more. This guard, for every request:

| request | answer |
|---|---|
| `/health` (the readiness probe: says nothing, changes nothing) | passed on, with or without a key |
| anything else without `Authorization: Bearer <the instance's key>` | 401 |
| with the key, a route Stoker calls (`KEYED_PATHS`, `/v1/…`) | passed on |
| with the key, any other route (`/collective_rpc`, every other dev-mode route, `/docs`, …) | 403 |

An allow-list, not a deny-list: a route a later vLLM adds is refused until Stoker calls it.

Why vLLM's `--middleware` rather than a guard process in front of vLLM: no extra hop on every
streamed token, no second port to allocate, probe and keep in step with the engine's life, and
nothing that could be reached around (vLLM listens only where the guard is). vLLM imports the class
named by `--middleware` and calls `app.add_middleware(cls)` (a function would go to
`app.middleware("http")`, which wraps every response in Starlette's buffered BaseHTTPMiddleware):
a class added last is the outermost, so this runs before vLLM's CORS, its own key check and every
route. It is plain ASGI: the body is never read and a stream passes through untouched.

Standard library only: this file is imported by vLLM's Python, where Stoker is not installed. The
pool puts the directory that holds only this file on vLLM's `PYTHONPATH` (`warm_pool.launch`); the
engine image ships it (infra/docker/Dockerfile.engine). It takes the key from `VLLM_API_KEY` (vLLM
gives a middleware class no arguments) and refuses to be built without one: a vLLM started with the
guard and no key fails its start instead of serving open. The key is compared in constant time and
never logged, nor is any header.
"""

from __future__ import annotations

import hmac
import json
import logging
import os

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
# The routes Stoker calls on an engine besides /v1: the pool's readiness facts (/server_info), its
# load and start phases (/metrics), sleep and wake, and its check of what the engine says it is doing
# (warm_pool.engine_calls, engine_signals, reconcile).
KEYED_PATHS = frozenset({"/metrics", "/server_info", "/sleep", "/wake_up", "/is_sleeping"})
KEYED_PREFIXES = ("/v1/",)  # OpenAI's API, which the gateways proxy

log = logging.getLogger("stoker_vllm_guard")


def decide(path: str, authorization: bytes | None, expected: bytes) -> int:
    """What the guard does with a request to `path` carrying `authorization`: 0 (pass it on), 401
    or 403. `expected` is `b"Bearer " + key`."""
    if path in OPEN_PATHS:
        return 0
    if not hmac.compare_digest(authorization or b"", expected):
        return 401
    if path in KEYED_PATHS or path.startswith(KEYED_PREFIXES):
        return 0
    return 403


def _error(status: int, message: str, kind: str, code: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers, body


UNAUTHORIZED = _error(
    401,
    "A valid API key is required: send `Authorization: Bearer KEY`.",
    "authentication_error",
    "invalid_api_key",
)
FORBIDDEN = _error(
    403, "Stoker does not serve this route of the engine.", "permission_error", "route_refused"
)


class EngineGuard:
    """Pure ASGI middleware: see the module's docstring."""

    def __init__(self, app, key: str | None = None) -> None:
        key = os.environ.get(KEY_ENV, "") if key is None else key
        if not key:
            raise RuntimeError(f"stoker_vllm_guard: {KEY_ENV} is not set; refusing to serve unguarded")
        self.app = app
        self._expected = b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        # As vLLM's own check: routes are matched below `--root-path`, if one is set.
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        status = decide(path, given, self._expected)
        if status == 0:
            await self.app(scope, receive, send)
            return
        if status == 403:  # only a holder of the key gets here: Stoker itself, or the key leaked
            log.warning("refused %s %s: not a route Stoker serves", scope.get("method", "WEBSOCKET"), path)
        if scope["type"] == "websocket":  # closed before it is accepted: the server answers 403
            await send({"type": "websocket.close", "code": 1008})
            return
        headers, body = UNAUTHORIZED if status == 401 else FORBIDDEN
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
