"""The bytes of inference request bodies one gateway holds at once, bounded.

A body is read whole before anything else happens to its request: its `model` names the deployment.
It is then kept until the request ends: while held in an activator's queue (bounded by
`--max-queued`), while its answer streams, and for a refusal until its 503 is out. Each body is at
most `MAX_REQUEST_BYTES` (4 MiB), but nothing else bounded how many a gateway read at once, so its
memory grew with the clients offering them: 200 clients sending 1 MiB bodies at once to a
deployment with a full queue took `stoker up` from 82 MiB to 505 MiB of RSS, and it stayed there
(the allocator keeps what it was given). With a budget, a body that does not fit is refused before
it is read: 503 `server_overloaded` with `Retry-After`, in OpenAI's shape, so memory is bounded by
the budget (and about 2× for the parsed copy) whatever the clients offer.

Synchronous, on the event loop: `take` and `give` are atomic without a lock. What is counted is what
arrived, chunk by chunk; a body whose declared `Content-Length` (every OpenAI client sends one) would
not fit now is refused before a byte of it is read.
"""

from __future__ import annotations

from starlette.types import Receive, Scope

from stoker.errors import UNAVAILABLE, APIError
from stoker.http import read_body

BODY_MEMORY_BYTES = 256 << 20  # `--max-body-memory`: 64 bodies of the 4 MiB limit, thousands of chat requests
RETRY_AFTER_S = 1  # a body's bytes come back as soon as a request ends


class BodyBudget:
    def __init__(self, limit: int = BODY_MEMORY_BYTES) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"the body memory budget must be a positive number of bytes, got {limit!r}")
        self.limit = limit
        self.held = 0  # bytes of bodies taken and not yet given back

    def take(self, n: int) -> bool:
        """Reserve `n` more bytes; False, reserving nothing, if they do not fit."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)


def overloaded(budget: BodyBudget) -> APIError:
    return APIError(
        503,
        f"The gateway is holding {budget.limit} bytes of request bodies already; retry later.",
        type=UNAVAILABLE,
        code="server_overloaded",
        headers={"retry-after": str(RETRY_AFTER_S)},
    )


async def read_body_within(budget: BodyBudget, receive: Receive, scope: Scope, limit: int) -> bytes:
    """`read_body`, each chunk's bytes taken from `budget` as they arrive (a 503 `server_overloaded`
    once one does not fit), and refused before a byte is read when its declared length, or any byte
    at all, would not fit now; the caller gives back `len(body)` when its request ends. Counting
    what arrived, not what was declared, a client that declares 4 MiB and sends nothing holds
    nothing."""
    declared = next((int(v) for n, v in scope["headers"] if n == b"content-length" and v.isdigit()), 0)
    if declared <= limit and budget.held + max(declared, 1) > budget.limit:  # over the limit: the 413
        raise overloaded(budget)
    taken = 0

    def keep(chunk: bytes) -> None:
        nonlocal taken
        if not budget.take(len(chunk)):
            raise overloaded(budget)
        taken += len(chunk)

    try:
        return await read_body(receive, scope, limit, keep)
    except BaseException:
        budget.give(taken)
        raise
