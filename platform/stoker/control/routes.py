"""Where cascade routes are kept: `CascadeRoutes`, the one that owns them (SQLite, in `stoker up`
and in `stoker controller`; on a cluster StokerRoute resources instead, `stoker.control.kube.routes`,
behind the same interface); the admin API writes it (`stoker.gateway.cascade.RouteTable`). A
gateway of its own serves a read-only copy of it (`stoker.gateway.routes.SyncedRoutes`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from stoker.gateway.cascade import Cascades, RouteTable
from stoker.paths import open_database
from stoker.spec.routes import CascadeRoute, route_not_found


class CascadeRoutes:
    """Routes in SQLite (the registry's `stoker.db`, table `cascade_routes`, its own connection),
    mirrored in memory so that the request path never touches the database."""

    def __init__(self, path: Path) -> None:
        self._db = open_database(path)  # autocommit; `with` for transactions
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS cascade_routes ("
            " name TEXT PRIMARY KEY, route TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)"
        )
        rows = self._db.execute("SELECT route FROM cascade_routes ORDER BY created_at, name").fetchall()
        self._routes = {r.name: r for r in (CascadeRoute(**json.loads(text)) for (text,) in rows)}

    async def put(self, route: CascadeRoute) -> bool:
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

    async def delete(self, name: str) -> CascadeRoute:
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


def owned_cascades(platform: Any, table: RouteTable | None = None) -> Cascades:
    """The cascade routes a process owns (`stoker up`, `stoker controller`): served from `table`
    (on a cluster, StokerRoute resources: `stoker.control.kube.routes`), by default this table in
    the platform's `stoker.db`, opened at first use (`stoker.gateway.cascade`)."""
    return Cascades(
        platform,
        platform.metrics_registry,
        table=(lambda: table)
        if table is not None
        else lambda: CascadeRoutes(Path(platform.data_dir) / "stoker.db"),
    )
