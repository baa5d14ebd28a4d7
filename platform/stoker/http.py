"""Small pure-ASGI helpers shared by the gateway and the CPU engine."""

from __future__ import annotations

from starlette.types import Receive, Scope

from stoker.openai_errors import APIError


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
