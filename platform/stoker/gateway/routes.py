"""A gateway's copy of the controller's cascade routes: replaced whole from each routing table
(`stoker.serve.controller.routing_table`, key `cascades`), never written here. What serving reads
of it is `stoker.gateway.cascade.RouteSource`'s (`get`, `all`); the controller's own table, which
the admin API writes, is `stoker.control.routes.CascadeRoutes`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stoker.spec.routes import FIELDS, CascadeRoute


class SyncedRoutes:
    """A gateway's copy of the controller's routes, with each one's small deployment's context (for
    the pre-check; None: unknown there, no pre-check). `replace` takes the routing table's entries:

        {"name": "assist", "small": "smol", "large": "big", "min_mean_logprob": -1.0,
         "escalate_on_context": true, "small_context": 2048}

    Each `on_removed(name)` (given here, or later by `subscribe`) hears of each route that left (its
    series are forgotten)."""

    def __init__(self, on_removed: Callable[[str], None] | None = None) -> None:
        self._routes: dict[str, CascadeRoute] = {}
        self._contexts: dict[str, int | None] = {}
        self._listeners: list[Callable[[str], None]] = [on_removed] if on_removed is not None else []

    def subscribe(self, on_removed: Callable[[str], None]) -> None:
        self._listeners.append(on_removed)

    def replace(self, entries: list[dict[str, Any]]) -> None:
        routes = {e["name"]: CascadeRoute(**{f: e[f] for f in FIELDS}) for e in entries}
        contexts = {e["name"]: e.get("small_context") for e in entries}
        gone = [name for name in self._routes if name not in routes]
        self._routes, self._contexts = routes, contexts
        for name in gone:
            for listener in self._listeners:
                listener(name)

    def get(self, name: str) -> CascadeRoute | None:
        return self._routes.get(name)

    def all(self) -> list[CascadeRoute]:
        return list(self._routes.values())

    def small_context(self, route: CascadeRoute) -> int | None:
        context = self._contexts.get(route.name)
        return context if isinstance(context, int) and not isinstance(context, bool) else None
