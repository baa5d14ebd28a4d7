"""The request taps: what watches one inference request on its way through the gateway, declared as
one list with one protocol and run in one order.

A tap wraps the ASGI `send` of the request when it starts (`start`: the wrapped `send`, and what to
call when the request ends) and hears its end, whatever the outcome. They run outermost first:

    1. cost      (`CostTap`: stoker.control.cost's meter, or a gateway's `GatewayMeter`) — tokens,
                  requests and in-flight time of every answer, refused ones included;
    2. log       (`LogTap`: stoker.gateway.request_log's `Observer`) — the request log, drift and
                  traces, so a 429 from the limits below is logged and traced too;
    3. limits    (`LimitTap`: stoker.gateway.limits' `Limiter`) — admits the caller's key (a 429
                  `APIError` when over a limit), adds x-ratelimit-* headers, settles the tokens used;

and, once the split has picked the revision, the innermost: the revision's `Recorder`
(`stoker.gateway.revisions.answer_on`: x-stoker-revision, the status and first byte per revision).
Their ends run in the reverse order (limits settle first, the meter counts last), as nested
`finally` blocks would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import Send

from stoker.gateway.limits import Limiter, UsageTap
from stoker.spec.keys import Principal

Finish = Callable[[dict], None]  # called with the request's scope once it has ended


@dataclass(frozen=True)
class TappedRequest:
    """What a tap may read of the request it watches."""

    name: str  # the model it called: a deployment, or a cascade route
    deployment: Any  # what answers it (a deployment, or a cascade route's target)
    principal: Principal
    parsed: dict
    stream: bool
    estimate: tuple[int, int]  # (prompt tokens, completion tokens at most), as the limits charge


class Tap(Protocol):
    def start(self, send: Send, request: TappedRequest) -> tuple[Send, Finish | None]:
        """The `send` to answer through from here in, and what to call at the end (None: nothing).
        May raise an `APIError` (the limits' 429): the request is then answered with it, through
        the taps started before this one."""
        ...


class CostTap:
    """Every answer counted for cost (`meter`: a `CostMeter` or a gateway's `GatewayMeter`)."""

    def __init__(self, meter: Any) -> None:
        self.meter = meter

    def start(self, send: Send, request: TappedRequest) -> tuple[Send, Finish | None]:
        metered = self.meter.tap(send, request.name, request.estimate[0])
        if metered is None:  # a name with no pool here (a cascade route)
            return send, None
        return metered, lambda scope: self.meter.done(metered, scope)


class LogTap:
    """The request log, drift and traces (`observer`: a `request_log.Observer`)."""

    def __init__(self, observer: Any) -> None:
        self.observer = observer

    def start(self, send: Send, request: TappedRequest) -> tuple[Send, Finish | None]:
        r = request
        observed = self.observer.tap(send, r.name, r.deployment, r.principal.key_id, r.parsed, r.stream)
        if observed is None:
            return send, None
        return observed, lambda scope: self.observer.done(observed, scope)


class LimitTap:
    """The caller's key's limits (the admin's key is never limited)."""

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter

    def start(self, send: Send, request: TappedRequest) -> tuple[Send, Finish | None]:
        p = request.principal
        if p.admin:
            return send, None
        ticket = self.limiter.admit(p.key_id, p.limits, request.estimate, p.tenant or "")
        if ticket is None:  # the key has no limit
            return send, None
        tap = UsageTap(send, ticket)

        def finish(scope: dict) -> None:
            if (used := tap.used()) is not None:
                ticket.settle(used)
            ticket.close()

        return tap, finish


def taps(limiter: Limiter, meter: Any = None, observer: Any = None) -> list[Tap]:
    """The taps of one gateway, in the order they run (see the module); a part not kept is left out."""
    out: list[Tap] = []
    if meter is not None:
        out.append(CostTap(meter))
    if observer is not None:
        out.append(LogTap(observer))
    out.append(LimitTap(limiter))
    return out
