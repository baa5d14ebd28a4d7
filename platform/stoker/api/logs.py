"""`GET /admin/v1/deployments/{name}/logs`: an instance's log, for `stoker logs`.

    ?instance=ID   one of the deployment's instances, live or gone (default: the one that wrote last)
    ?tail=N        the last N lines first (default 100, at most 10,000)
    ?follow=true   then what it writes next, streamed (chunked), until the client leaves, the
                   instance is gone and its log read to the end, or the platform stops

On the Kubernetes backend the log is the pod's, read through the API (`pods/log`, the engine
container's last `tail` lines, of a pod that still exists; default: the newest instance); a follow
there is `kubectl logs -f`'s (501, naming the command).

Pure ASGI, so a follow writes each read as it comes and notices a client that left while nothing
was being written (it watches `receive()` for the disconnect, as the activator does). The reading
itself is bounded and refuses links (`warm_pool.instance_logs`). Admin only, as every /admin route
(`keys.KeyAuth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from starlette.datastructures import QueryParams
from starlette.types import Receive, Scope, Send

from stoker.errors import APIError, error_response, invalid
from stoker.spec.deployment import not_found
from warm_pool.instance_logs import (
    MAX_TAIL_LINES,
    LogUnreadable,
    instance_pattern,
    logged_instances,
    open_log,
    read_more,
    read_tail,
    redact_lines,
)

DEFAULT_TAIL = 100
FOLLOW_POLL_S = 0.25  # how soon a follow shows a new line; each poll is one pread
MAX_PARTIAL_BYTES = 64 << 10  # a line longer than this goes out in pieces rather than held back


class InstanceLogs:
    """The endpoint. `platform` finds deployments (`.get(name)`, `.backend.log_dir`) and says when it
    is stopping (`.stopping()`): a follow then ends, so it cannot hold up a drain."""

    def __init__(self, platform, poll_s: float = FOLLOW_POLL_S) -> None:
        self.platform = platform
        self.poll_s = poll_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path_params"]["name"]
        try:
            deployment = self.platform.get(name)
            if deployment is None:
                raise not_found(name)
            query = QueryParams(scope.get("query_string", b""))
            if getattr(self.platform.backend, "log_dir", None) is None:
                await self._pod_log(name, deployment, query, scope, receive, send)
                return
            instance, tail, follow = self._params(name, query)
            path = self.platform.backend.log_dir / f"{instance}.log"
            try:
                fd = await asyncio.to_thread(open_log, path)
            except LogUnreadable as exc:
                raise APIError(
                    403, f"The log of {instance} cannot be read: {exc}", code="log_unreadable"
                ) from None
            if fd is None:
                raise APIError(
                    404,
                    f"No log for instance {instance!r}.",
                    type="not_found_error",
                    param="instance",
                    code="log_not_found",
                )
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        try:
            await self._stream(
                fd, tail, follow, lambda: self._alive(name, deployment, instance), receive, send
            )
        finally:
            os.close(fd)

    async def _pod_log(self, name: str, deployment, query: QueryParams, scope, receive, send) -> None:
        """A pod's log, as the Kubernetes API keeps it (`pods/log`): the last `tail` lines of its
        engine container, of a pod that still exists. A follow is kubectl's (`kubectl logs -f`)."""
        newest = sorted(
            (i for pool in deployment.pools() for i in pool.instances()), key=lambda i: i["since"]
        )
        instance, tail, follow = self._params(name, query, default=newest[-1]["id"] if newest else None)
        if follow:
            raise APIError(
                501,
                f"Following a pod's log is kubectl's: `kubectl logs -f {instance} -c engine`.",
                code="logs_elsewhere",
            )
        text = await self.platform.backend.tail_log(instance, tail)
        if text is None:
            raise APIError(
                404,
                f"No log for instance {instance!r}: its pod is gone, or has written none yet.",
                type="not_found_error",
                param="instance",
                code="log_not_found",
            )
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": redact_lines(text.encode())})

    def _params(self, name: str, query: QueryParams, default: str | None = None) -> tuple[str, int, bool]:
        """The instance (given, else `default`, else the one that wrote last here), tail and follow."""
        instance = query.get("instance") or default
        if instance is not None and not instance_pattern(name).fullmatch(instance):
            raise invalid(
                f"'instance' must be an instance id of {name!r} ({name}-<8 hex>), got {instance!r}.",
                "instance",
            )
        if instance is None and getattr(self.platform.backend, "log_dir", None) is None:
            raise APIError(
                404,
                f"No instance of {name!r} runs now: name one with 'instance'.",
                type="not_found_error",
                code="log_not_found",
            )
        if instance is None:
            logged = logged_instances(self.platform.backend.log_dir, name)
            if not logged:
                raise APIError(
                    404,
                    f"No instance of {name!r} has written a log yet.",
                    type="not_found_error",
                    code="log_not_found",
                )
            instance = logged[-1]
        raw = query.get("tail", str(DEFAULT_TAIL))
        if not raw.isdigit() or int(raw) > MAX_TAIL_LINES:
            raise invalid(f"'tail' must be a number of lines in 0..{MAX_TAIL_LINES}, got {raw!r}.", "tail")
        follow = query.get("follow", "false").lower()
        if follow not in ("true", "false", "1", "0"):
            raise invalid(f"'follow' must be true or false, got {follow!r}.", "follow")
        return instance, int(raw), follow in ("true", "1")

    def _alive(self, name: str, deployment, instance: str) -> bool:
        """Still worth following: the deployment is the same one, and the instance is in its pool."""
        if self.platform.get(name) is not deployment:
            return False
        return any(i["id"] == instance for pool in deployment.pools() for i in pool.instances())

    async def _stream(
        self, fd: int, tail: int, follow: bool, alive: Callable[[], bool], receive: Receive, send: Send
    ) -> None:
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        data, offset = await asyncio.to_thread(read_tail, fd, tail)
        await send({"type": "http.response.body", "body": redact_lines(data), "more_body": follow})
        if not follow:
            return
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            with contextlib.suppress(OSError):  # a send to a client that just left
                await self._follow(fd, offset, alive, gone, send)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()

    async def _follow(self, fd: int, offset: int, alive, gone: asyncio.Future, send: Send) -> None:
        pending = b""  # a line whose end is not written yet
        while not gone.done():
            chunk = await asyncio.to_thread(read_more, fd, offset)
            if chunk:
                offset += len(chunk)
                pending += chunk
                cut = pending.rfind(b"\n") + 1
                if cut == 0 and len(pending) >= MAX_PARTIAL_BYTES:
                    cut = len(pending)
                if cut:
                    out, pending = pending[:cut], pending[cut:]
                    await send({"type": "http.response.body", "body": redact_lines(out), "more_body": True})
                continue  # more may be waiting: read again before sleeping
            if not alive() or self.platform.stopping():
                if pending:
                    await send(
                        {"type": "http.response.body", "body": redact_lines(pending), "more_body": True}
                    )
                return
            await asyncio.wait({gone}, timeout=self.poll_s)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
