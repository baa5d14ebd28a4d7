"""Bad input through `stoker up`: refused by the gateway or by the engine behind it, and neither the
instance nor the client's connection is the worse for it."""

from __future__ import annotations

import httpx

from tests.platform.engine.conftest import OneConnection
from tests.platform.engine.test_bad_input import nested


def test_hostile_bodies_leave_the_instance_and_the_connection_serving(shared_platform):
    conn = OneConnection(shared_platform.url)
    try:
        # The engine's refusal (the gateway only reads `model` and `stream`), relayed as it is.
        status, headers, answer = conn.post("/v1/completions", {"model": "tiny", "prompt": ""})
        assert (status, answer["error"]["param"]) == (400, "prompt"), answer
        instance = headers["x-stoker-instance"]
        # The gateway's own, from its parser, before any instance is picked.
        status, _, answer = conn.post("/v1/completions", {"model": "tiny", "prompt": "\ud800"})
        assert (status, answer["error"]["param"]) == (400, "prompt"), answer
        status, _, answer = conn.post("/v1/chat/completions", nested(100_000))
        assert (status, answer["error"]["code"]) == (400, "invalid_json"), answer
        # The same instance still generates: its loop never saw the empty prompt.
        status, headers, answer = conn.post(
            "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}
        )
        assert status == 200, answer
        assert headers["x-stoker-instance"] == instance
    finally:
        conn.close()
    assert httpx.get(f"{shared_platform.url}/healthz").status_code == 200
