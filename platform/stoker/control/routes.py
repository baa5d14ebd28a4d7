"""Where cascade routes are kept: `CascadeRoutes`, the one that owns them (SQLite, in `stoker up`
and in `stoker controller`), and `SyncedRoutes`, a gateway's read-only copy of the controller's,
replaced whole from each routing table (`stoker.serve.planes.routing_table`, key `cascades`). Both give
what serving reads (`stoker.gateway.cascade.RouteSource`: `get`, `all`); only the first can be written.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoker.spec.routes import FIELDS, CascadeRoute, route_not_found


class CascadeRoutes:
    """Routes in SQLite (the registry's `stoker.db`, table `cascade_routes`, its own connection),
    mirrored in memory so that the request path never touches the database."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)  # autocommit; `with` for transactions
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS cascade_routes ("
            " name TEXT PRIMARY KEY, route TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)"
        )
        rows = self._db.execute("SELECT route FROM cascade_routes ORDER BY created_at, name").fetchall()
        self._routes = {r.name: r for r in (CascadeRoute(**json.loads(text)) for (text,) in rows)}

    def put(self, route: CascadeRoute) -> bool:
        """Create or replace `route`; whether it was created."""
        now = time.time()
        with self._db:
            self._db.execute(
                "INSERT INTO cascade_routes (name, route, created_at, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET route = excluded.route, updated_at = excluded.updated_at",
                (route.name, json.dumps(route.to_dict()), now, now),
            )
        created = route.name not in self._routes
        self._routes[route.name] = route
        return created

    def get(self, name: str) -> CascadeRoute | None:
        return self._routes.get(name)

    def delete(self, name: str) -> CascadeRoute:
        route = self._routes.get(name)
        if route is None:
            raise route_not_found(name)
        with self._db:
            self._db.execute("DELETE FROM cascade_routes WHERE name = ?", (name,))
        del self._routes[name]
        return route

    def all(self) -> list[CascadeRoute]:
        return list(self._routes.values())

    def close(self) -> None:
        self._db.close()


class SyncedRoutes:
    """A gateway's copy of the controller's routes, with each one's small deployment's context (for
    the pre-check; None: unknown there, no pre-check). `replace` takes the routing table's entries:

        {"name": "assist", "small": "smol", "large": "big", "min_mean_logprob": -1.0,
         "escalate_on_context": true, "small_context": 2048}

    `on_removed(name)` hears of each route that left (its series are forgotten)."""

    def __init__(self, on_removed: Callable[[str], None] | None = None) -> None:
        self._routes: dict[str, CascadeRoute] = {}
        self._contexts: dict[str, int | None] = {}
        self.on_removed = on_removed

    def replace(self, entries: list[dict[str, Any]]) -> None:
        routes = {e["name"]: CascadeRoute(**{f: e[f] for f in FIELDS}) for e in entries}
        contexts = {e["name"]: e.get("small_context") for e in entries}
        gone = [name for name in self._routes if name not in routes]
        self._routes, self._contexts = routes, contexts
        for name in gone:
            if self.on_removed is not None:
                self.on_removed(name)

    def get(self, name: str) -> CascadeRoute | None:
        return self._routes.get(name)

    def all(self) -> list[CascadeRoute]:
        return list(self._routes.values())

    def small_context(self, route: CascadeRoute) -> int | None:
        context = self._contexts.get(route.name)
        return context if isinstance(context, int) and not isinstance(context, bool) else None
