"""Small pure-ASGI helpers shared by the gateway and the CPU engine."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stoker.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    SERVER_ERROR,
    APIError,
    error_response,
    invalid,
    unauthorized,
)

log = logging.getLogger("stoker.http")


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(
    receive: Receive, scope: Scope, limit: int, keep: Callable[[bytes], None] | None = None
) -> bytes:
    """The whole request body, refusing (413) anything over `limit` bytes without reading it all.
    `keep`, if given, hears of each chunk before it is kept, and may refuse it by raising."""
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
        if keep is not None:
            keep(chunk)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


# Deeper than any OpenAI request needs (a chat message's content part sits at depth 4), shallow
# enough that nothing that walks a body, ours or a library's, can run out of stack.
MAX_JSON_DEPTH = 64
# The one bound on an inference request's body (chat, completions, responses, embeddings, a batch
# line): enforced where the body first arrives (the gateway, 413), and the engine's own default, so a
# body the gateway forwards is never refused by the engine behind it for its size.
MAX_REQUEST_BYTES = 4 << 20

# A string, or an unterminated one up to the end: a pattern that may fail at a quote would be retried
# at every later quote, quadratic on a body of escaped quotes.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """A request body that must be one JSON object, or a 400 in OpenAI's shape.

    Sizes are bounded before this (`read_body`); here the rest is: UTF-8 only, nesting at most
    `max_depth` deep (checked before `json` parses, since it recurses and would die of a
    RecursionError at ~1000 levels), numbers of at most 4300 digits (Python's own limit), no
    NaN/Infinity (not JSON), and no string that cannot be encoded back to UTF-8: a lone surrogate
    escape such as "\\ud800" parses to a str that every later encode (tokenizer, response) fails on.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"The request body is not valid UTF-8: {exc}", code="invalid_json") from None
    if nesting_exceeds(raw, max_depth):
        raise invalid(f"The request body nests deeper than {max_depth} levels.", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:  # JSONDecodeError, and the 4300-digit limit on integers
        raise invalid(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # the only way a surrogate gets in once the bytes are UTF-8
        _refuse_surrogates(body)
    return body


def nesting_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether the JSON text `raw` nests arrays and objects deeper than `max_depth`, without recursing.

    Strings are cut out, everything but brackets is dropped, and each pass removes the innermost
    pairs: `[[],[[]]]` is empty after 3 passes, its depth. Whatever still holds a pair after
    `max_depth` passes is deeper. Each pass is one C-speed `replace` (about 10 ms on 4 MiB of
    brackets); `max_depth` + 1 opening brackets in a row end it early. Unbalanced text is left to
    the parser.
    """
    shape = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    shape = shape.replace(b"{", b"[").replace(b"}", b"]")
    too_deep = b"[" * (max_depth + 1)  # a plain chain is caught at once, not after max_depth passes
    for _ in range(max_depth):
        if not shape:
            return False
        if too_deep in shape:
            return True
        shape = shape.replace(b"[]", b"")
    return b"[]" in shape


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _refuse_surrogates(body: dict) -> None:
    """A 400 naming the first string field (or key) holding a lone surrogate, as `a.b[2].c`."""
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if not _encodable(value):
                raise invalid(
                    f"'{path}' holds a lone UTF-16 surrogate, which is not valid Unicode text.", param=path
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else key
                if not _encodable(key):
                    where = path or "the request body"
                    raise invalid(f"A key in {where} holds a lone UTF-16 surrogate.", param=path or None)
                todo.append((name, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def openai_exception_handlers() -> dict:
    """Starlette exception handlers that answer our errors and routing errors in OpenAI's shape.
    Anything else is `InternalErrors`' to answer."""

    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, type=kind))

    return {APIError: api_error, HTTPException: http_error}


def internal_error(component: str) -> APIError:
    return APIError(500, f"Internal error in the {component}.", type=SERVER_ERROR)


class BearerAuth:
    """Pure ASGI middleware: every request but those to `open_paths` must carry
    `Authorization: Bearer <key>`, else a 401 in OpenAI's shape. The key is compared in constant
    time; the body is never read before the check."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str] = frozenset()) -> None:
        if not key:
            raise ValueError("BearerAuth needs a non-empty key")
        self.app = app
        self._expected = b"Bearer " + key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        await error_response(unauthorized())(scope, receive, send)


class AdminGuard:
    """Pure ASGI middleware for the admin API (`prefix`): refuses what a browser on another site
    could send it, before any body is read.

    - An `Origin` header that is not one of `origins` is a 403: browsers add Origin to cross-site
      requests (and to every POST), scripts and the CLI send none.
    - A POST, PUT or PATCH whose content-type is not `application/json` is a 415: an HTML form or a
      `text/plain` fetch needs no CORS preflight, a JSON one does, and the preflight gets no
      CORS headers here, so a page elsewhere cannot make the browser send the request at all. One
      with no content-type is refused too (a browser's Blob body may carry none).

    In open mode (no admin key) the same guard stands before `/v1/` too (`prefix="/v1/"`), so a
    page elsewhere cannot spend the machine's compute with a `text/plain` POST; `not_json` names the
    paths that take another media type there (`/v1/files`, multipart), which keep the Origin check.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        origins: frozenset[str],
        prefix: str = "/admin/",
        not_json: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.origins = origins
        self.prefix = prefix
        self.not_json = not_json

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is not None and origin.decode("latin-1").rstrip("/").lower() not in self.origins:
            error = APIError(
                403,
                f"Cross-origin requests to the admin API are refused (Origin: {origin.decode('latin-1')!r}).",
                type="permission_error",
                code="forbidden_origin",
            )
            await error_response(error)(scope, receive, send)
            return
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if (
            scope["method"] in ("POST", "PUT", "PATCH")
            and media_type != b"application/json"
            and scope["path"] not in self.not_json
        ):
            what = "The admin API" if self.prefix == "/admin/" else "This platform runs open (no keys): it"
            error = APIError(
                415,
                f"{what} takes JSON only: send `content-type: application/json`.",
                code="unsupported_media_type",
            )
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HostGuard:
    """Pure ASGI middleware for a platform that runs open (no admin key): only requests whose
    `Host` is one of this machine's own names for it are served. A DNS-rebinding page (its name
    pointed at 127.0.0.1) sends its own name as Host, and reads nothing. Starlette's
    `TrustedHostMiddleware` decides; the refusal is ours, in OpenAI's shape. `hosts` None: any (a
    platform opened to every address on purpose, `--allow-open` on 0.0.0.0)."""

    def __init__(self, app: ASGIApp, *, hosts: frozenset[str] | None) -> None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        self.app = app
        self.hosts = hosts
        self._check = TrustedHostMiddleware(
            self._passed, allowed_hosts=sorted(hosts or ["*"]), www_redirect=False
        )

    @staticmethod
    async def _passed(scope: Scope, receive: Receive, send: Send) -> None:
        scope["stoker.host_ok"] = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hosts is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def dropped(message: Message) -> None:  # the check's own plain-text refusal
            return None

        await self._check(scope, receive, dropped)
        if scope.pop("stoker.host_ok", False):
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")[:200]
        error = APIError(
            400,
            f"Host {host!r} is not this machine's name for the platform, and it runs open (no keys): "
            "it answers only its loopback names. Set STOKER_ADMIN_KEY to serve other names.",
            code="invalid_host",
        )
        await error_response(error)(scope, receive, send)


def own_hosts(host: str) -> frozenset[str] | None:
    """The `Host` names a platform bound to `host` answers to when it runs open: that address and
    the loopback names; None (any) for every address (0.0.0.0, ::)."""
    if host in ("0.0.0.0", "::"):
        return None
    names = {host.strip("[]").lower()}
    if is_loopback(host):
        names |= {"127.0.0.1", "localhost", "::1"}
    return frozenset(names)


def own_origins(host: str, port: int) -> frozenset[str]:
    """The origins a browser gives pages served by a platform bound to `host:port`: that address,
    and the loopback names when it is loopback or every address (0.0.0.0, ::)."""
    names = {host}
    if host in ("0.0.0.0", "::") or is_loopback(host):
        names |= {"127.0.0.1", "localhost", "[::1]"}
    return frozenset(f"{scheme}://{name}:{port}".lower() for name in names for scheme in ("http", "https"))


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class InternalErrors:
    """Pure ASGI middleware: an unexpected exception fails its own request, with a 500 in OpenAI's
    shape, and nothing else.

    Starlette's outermost `ServerErrorMiddleware` would answer the same 500 but then re-raise, and
    uvicorn closes a connection whose app raised: the client's next request on it is reset. So the
    exception stops here. Once the response has started it is re-raised: closing the connection is
    then the only way left to tell the client its body is broken.
    """

    def __init__(self, app: ASGIApp, component: str) -> None:
        self.app = app
        self.component = component

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s", scope.get("path"))
            await error_response(internal_error(self.component))(scope, receive, send)


class ServerStopping:
    """Whether the server that serves an app has begun to stop (uvicorn's `should_exit`), for the
    parts of the app built before the server is (long polls and log follows end then, instead of
    holding a drain for its grace period). Made by the wiring, handed to those parts, and bound to
    the server by whoever creates it (`bind`); false until then. `stop` begins the server's stop
    from inside the app (a controller that lost its Lease)."""

    def __init__(self) -> None:
        self._server = None

    def bind(self, server) -> None:
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    def __call__(self) -> bool:
        return self._server is not None and bool(self._server.should_exit)


ARRIVING_GRACE_S = 0.5  # on a stop, how long a connection accepted before it may still send its request


def make_server(app, *, host: str, port: int, log_level: str, grace_period_s: float, tls=None):
    """A uvicorn server for `app`: no access log, in-flight requests get `grace_period_s` on SIGTERM,
    and so do requests still arriving on connections accepted before it (`_Server`); HTTPS only
    where `tls` (a `stoker.tls.TlsSettings`) holds a certificate."""
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's, but a stop does not cut a request still arriving. uvicorn's stop closes every
        connection with no request under way at once, and that is also one it accepted a moment
        before whose request bytes it has not read yet: its client, which had connected before the
        stop, sees the connection reset with no answer (a gateway's SIGTERM under load cut one or
        two such requests in three runs of the split planes' fault scenario). This one stops
        accepting first, then gives such connections up to `ARRIVING_GRACE_S` to begin their
        request, which is then served within the grace period like any other."""

        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            loop = asyncio.get_running_loop()
            end = loop.time() + min(ARRIVING_GRACE_S, grace_period_s)
            while loop.time() < end and any(_waiting(c) for c in self.server_state.connections):  # noqa: ASYNC110 (uvicorn signals no such event)
                await asyncio.sleep(0.01)
            await super().shutdown(sockets=None)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=grace_period_s,
        timeout_keep_alive=30,
        **(tls.server_options() if tls is not None else {}),
    )
    return _Server(config)


def _waiting(connection) -> bool:
    """A connection with no request under way that has never had one: accepted, its request not
    yet read (uvicorn's protocols keep the request under way as `cycle`, None until the first)."""
    return getattr(connection, "cycle", None) is None and not connection.transport.is_closing()


def run_server(server) -> bool:
    """Serve until SIGTERM or Ctrl-C; False if the server could not start (port taken).

    uvicorn drains on SIGTERM (stops accepting, waits up to the grace period for requests in
    flight), then re-raises the signal under the handler it found at start, so the process would
    die by the signal. Finding SIGTERM ignored makes a drained stop exit 0.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server.run()
    return server.started
