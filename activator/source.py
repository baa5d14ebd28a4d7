"""What the activator needs from a source of instances, and what it reports about load.

The composition root hands each deployment's `Activator` an `InstanceSource` (the warm pool, in
production; a small in-memory one in tests). The activator never imports the pool: these two
protocols and the `Load` value are the whole contract between them.

A source may also offer `expected_start_s() -> float | None`: how long the start a held request
waits on is expected to take (the pool's measured figure for the tier it comes from). The
activator then holds its requests that long and more (`Activator._hold_for`); a source without it,
or without a figure yet, gets the fixed `hold_deadline_s`. A gateway's `RemoteSource` has the
controller's figure, sent with the routing table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Endpoint(Protocol):
    """A READY instance the activator may send requests to."""

    @property
    def id(self) -> str: ...  # instance id, echoed in `x-stoker-instance`

    @property
    def url(self) -> str: ...  # base URL, e.g. "http://127.0.0.1:41234"

    @property
    def max_concurrency(self) -> int: ...  # requests it takes at once; more wait in the activator

    @property
    def auth_headers(self) -> Mapping[str, str]: ...  # sent with every request to it: its key, if any


class InstanceSource(Protocol):
    def endpoints(self) -> Sequence[Endpoint]:
        """The instances that may take new requests now (READY, not draining)."""
        ...

    def poke(self) -> None:
        """Demand is waiting with no capacity for it: decide now, not at the next tick."""
        ...

    def report_failure(self, endpoint_id: str) -> None:
        """An instance failed a request before answering (connection refused or reset)."""
        ...

    def report_unhealthy(self, endpoint_id: str, reason: str) -> None:
        """An instance says it is failed (its /health answered 503): replace it, if it is still
        meant to take requests (an instance on its way to sleep or out may say 503 and is fine)."""
        ...

    def request_arrived(self) -> None:
        """A request entered the activator, whether it found a slot at once or was held."""
        ...

    def request_finished(self, service_s: float | None, cold_on: str | None) -> None:
        """A request that arrived has left: after holding instances for `service_s` seconds in all,
        or without ever holding one (None: refused, expired, or its client left while it was held).

        `cold_on` names the instance that served it if that was a cold start: an instance that was
        not in the routing set when the request arrived (it started or woke up since), else None.
        Called exactly once for every `request_arrived`."""
        ...


@dataclass(frozen=True)
class Load:
    """What the activator saw, for the scaler: requests in flight upstream and held here."""

    in_flight: int
    queued: int
    last_arrival: float | None  # the activator's clock at the most recent request, None if none yet
    outstanding: Mapping[str, int] = field(default_factory=dict)  # in flight per endpoint id
