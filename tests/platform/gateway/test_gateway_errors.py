"""The one table from the activator's errors to what a client sees, pinned."""

from __future__ import annotations

import pytest

from activator import DeadlineExceeded, QueueFull, Unavailable, UpstreamError
from stoker.gateway.endpoint import api_error


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code", "retry_after"),
    [
        (QueueFull(3, 100), 503, "service_unavailable_error", "queue_full", "3"),
        (DeadlineExceeded(2, 120.0), 503, "service_unavailable_error", "hold_deadline", "2"),
        (
            Unavailable("snapshot ab12 is corrupt", 2),
            503,
            "service_unavailable_error",
            "deployment_unavailable",
            "2",
        ),
        (UpstreamError("tiny-1: cannot connect"), 502, "server_error", "upstream_failed", None),
    ],
)
def test_activator_errors_map_to_openai_errors(exc, status, kind, code, retry_after):
    err = api_error(exc)
    assert (err.status, err.type, err.code) == (status, kind, code)
    assert err.headers.get("retry-after") == retry_after
    assert err.body() == {"error": {"message": str(exc), "type": kind, "param": None, "code": code}}
