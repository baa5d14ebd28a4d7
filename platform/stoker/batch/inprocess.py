"""One batch line sent through the gateway's own `InferenceEndpoint` (an ASGI app), in this process,
as a client's request would be: the caller is the batch's key (`SCOPE_KEY`), the body is read
once, and the answer is collected, at most `MAX_ANSWER_BYTES` of it, and parsed as JSON.

The scope says it is in process (`activator.proxy.IN_PROCESS`): no proxy stands in between, so a
held line gets no whitespace keep-alive (`stoker up --plain-keepalive`), and the status it gets is
the answer's own, which decides whether it goes to the output file or the error file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from activator.proxy import IN_PROCESS
from stoker.gateway.keys import SCOPE_KEY
from stoker.spec.keys import Principal

MAX_ANSWER_BYTES = 64 << 20


async def call(
    endpoint: Callable, path: str, body: bytes, principal: Principal, batch_id: str
) -> tuple[int, dict[str, str], Any]:
    """POST `body` to `path` of `endpoint` as `principal`: (status, headers, JSON). An answer over
    the bound, or not JSON, is a 502 with OpenAI's error object."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-stoker-batch", batch_id.encode()),
        ],
        "client": None,
        "server": None,
        SCOPE_KEY: principal,
        IN_PROCESS: True,
    }
    sent = False
    never = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the batch is the client, and never leaves; a cancel ends this
        return {"type": "http.disconnect"}

    status, headers, chunks, size = 0, {}, [], 0

    async def send(message: dict) -> None:
        nonlocal status, headers, size
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])
            }
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= MAX_ANSWER_BYTES:
                chunks.append(chunk)

    await endpoint(scope, receive, send)
    if size > MAX_ANSWER_BYTES:
        return 502, headers, error(f"The answer is over {MAX_ANSWER_BYTES} bytes.")
    try:
        return status or 502, headers, json.loads(b"".join(chunks))
    except ValueError:
        return 502, headers, error("The answer is not JSON.")


def error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
