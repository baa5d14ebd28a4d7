"""The activator's errors: the only exceptions that leave the package.

aiohttp's errors (and timeouts) are translated into these where they enter, in `proxy.py`. Each
class carries what a client sees of it: the HTTP `status`, OpenAI's error `type` and `code`. This
is the one table from our request-path errors to HTTP: the gateway answers with it before any
header went out, the activator's own SSE error event uses it after, and each revision's answer
counts are kept by it (`tests/platform/gateway/test_gateway_errors.py` pins it).
"""

from __future__ import annotations


class ActivatorError(Exception):
    """Base of every error the activator raises to the gateway. Raised only before any header went
    to the client; once a response has started, the activator ends it with an SSE error event instead.

        ActivatorError         code                      status  type
        ├── NoCapacity         (retry_after_s)           503     service_unavailable_error
        │   ├── QueueFull      "queue_full"              503 + Retry-After
        │   ├── DeadlineExceeded "hold_deadline"         503 + Retry-After
        │   └── Unavailable    "deployment_unavailable"  503 + Retry-After
        └── UpstreamError      "upstream_failed"         502     server_error

    `code` is OpenAI's error `code` field; `str(exc)` is a one-line message for the client.
    """

    code = "activator_error"
    status = 500
    type = "server_error"


class NoCapacity(ActivatorError):
    """No instance could take the request; the client may retry after `retry_after_s` seconds."""

    status = 503
    type = "service_unavailable_error"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(NoCapacity):
    """The hold queue is at its bound: refused at once, without waiting."""

    code = "queue_full"

    def __init__(self, retry_after_s: int, max_queued: int = 0) -> None:
        super().__init__(
            f"No capacity: {max_queued} requests are already waiting for an instance; retry later.",
            retry_after_s,
        )
        self.max_queued = max_queued


class DeadlineExceeded(NoCapacity):
    """The request was held for `hold_deadline_s` and no instance became free."""

    code = "hold_deadline"

    def __init__(self, retry_after_s: int, held_s: float = 0.0) -> None:
        super().__init__(f"No instance became available within {held_s:.1f} s; retry later.", retry_after_s)
        self.held_s = held_s


class UpstreamError(ActivatorError):
    """The instance failed before answering, and so did the one retry on another instance."""

    code = "upstream_failed"
    status = 502
    type = "server_error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"The model instance failed before answering: {reason}")
        self.reason = reason


class Unavailable(NoCapacity):
    """The source said it cannot bring up an instance (say, its snapshot is corrupt), so held
    requests stop waiting now, and new ones are not held, instead of each waiting out its deadline.
    The message carries the source's reason."""

    code = "deployment_unavailable"

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(f"No instance can start: {reason}", retry_after_s)
        self.reason = reason
