"""Deployments by name, persisted in SQLite under the data dir: each name's revisions and its
traffic split. What a deployment is (its fields, defaults and validation) is `stoker.spec.deployment`.

The registry survives restarts: `stoker up` brings every deployment back from it. A row written
before a field existed reads as that field's default (rows are JSON, read into `DeploymentSpec` by
name).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from stoker.paths import open_database
from stoker.spec.deployment import DeploymentSpec


class DeploymentStore(Protocol):
    """Where deployments and their revisions are kept: SQLite (`Registry`, `stoker up` and a
    controller's data dir) or, on a cluster, the API server (`stoker.control.kube.registry`).
    Reads are from memory or a local file; writes may go over the network, so they are awaited."""

    def traffic(self, name: str) -> dict[int, int]: ...

    def revisions(self, name: str) -> list[tuple[DeploymentSpec, float]]: ...

    def revision(self, name: str, number: int) -> DeploymentSpec | None: ...

    def all(self) -> list[DeploymentSpec]: ...

    def serving(self) -> list[DeploymentSpec]: ...

    def set_traffic(self, name: str, traffic: dict[int, int]) -> None: ...

    def pending_switch(self, name: str) -> tuple[int, int] | None: ...

    def set_pending_switch(self, name: str, switch: tuple[int, int] | None) -> None: ...

    async def create_revision(
        self, spec: DeploymentSpec, *, take_traffic: bool = False
    ) -> DeploymentSpec: ...

    async def put(self, spec: DeploymentSpec) -> DeploymentSpec: ...

    async def delete(self, name: str) -> None: ...

    def close(self) -> None: ...


class Registry:
    """Deployments and their revisions in SQLite (`$STOKER_HOME/stoker.db`). Writes are single
    transactions.

    `revisions` keeps every revision of a name, immutable once written (its snapshot id and every
    setting); `deployments` keeps each name's newest revision's spec and its traffic split
    (revision -> percent). A database written before revisions existed is read as revision 1 with
    all the traffic.
    """

    def __init__(self, path: Path) -> None:
        self._db = open_database(path)  # autocommit; `with` for transactions
        with self._transaction():
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS deployments ("
                " name TEXT PRIMARY KEY, spec TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS revisions ("
                " name TEXT NOT NULL, revision INTEGER NOT NULL, spec TEXT NOT NULL, created_at REAL NOT NULL,"
                " PRIMARY KEY (name, revision))"
            )
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(deployments)")}
            if "traffic" not in columns:
                self._db.execute("ALTER TABLE deployments ADD COLUMN traffic TEXT")
            if "pending" not in columns:  # a switch under way: [revision, percent]
                self._db.execute("ALTER TABLE deployments ADD COLUMN pending TEXT")
            # Rows from before revisions: each becomes its revision 1, serving everything.
            for name, spec, created in self._db.execute(
                "SELECT name, spec, created_at FROM deployments WHERE traffic IS NULL"
            ).fetchall():
                first = json.dumps({**json.loads(spec), "revision": 1})
                self._db.execute(
                    "INSERT OR IGNORE INTO revisions (name, revision, spec, created_at) VALUES (?, 1, ?, ?)",
                    (name, first, created),
                )
                self._db.execute(
                    "UPDATE deployments SET spec = ?, traffic = ? WHERE name = ?",
                    (first, json.dumps({"1": 100}), name),
                )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction (the connection autocommits each statement otherwise)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    async def create_revision(self, spec: DeploymentSpec, *, take_traffic: bool = False) -> DeploymentSpec:
        """Record `spec` as the name's next revision (returned with its `revision` set). The traffic
        split stays as it is, unless `take_traffic` (or it is the name's first revision): then all
        of it goes to the new revision."""
        now = time.time()
        with self._transaction():
            (latest,) = self._db.execute(
                "SELECT COALESCE(MAX(revision), 0) FROM revisions WHERE name = ?", (spec.name,)
            ).fetchone()
            spec = replace(spec, revision=latest + 1)
            text = json.dumps(spec.to_dict())
            self._db.execute(
                "INSERT INTO revisions (name, revision, spec, created_at) VALUES (?, ?, ?, ?)",
                (spec.name, spec.revision, text, now),
            )
            traffic = _traffic_json({spec.revision: 100}) if take_traffic or latest == 0 else None
            self._db.execute(
                "INSERT INTO deployments (name, spec, created_at, updated_at, traffic) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET spec = excluded.spec, updated_at = excluded.updated_at,"
                " traffic = COALESCE(excluded.traffic, deployments.traffic)",
                (spec.name, text, now, now, traffic),
            )
        return spec

    async def put(self, spec: DeploymentSpec) -> DeploymentSpec:
        """A new deployment, or a new revision of one that takes all the traffic at once."""
        return await self.create_revision(spec, take_traffic=True)

    def set_traffic(self, name: str, traffic: dict[int, int]) -> None:
        self._db.execute(
            "UPDATE deployments SET traffic = ?, updated_at = ? WHERE name = ?",
            (_traffic_json(traffic), time.time(), name),
        )

    def set_pending_switch(self, name: str, switch: tuple[int, int] | None) -> None:
        """The switch under way (revision, percent), kept until it ends, so that a controller
        restarted meanwhile resumes it (`Platform.start`); None: none."""
        text = None if switch is None else json.dumps([int(switch[0]), int(switch[1])])
        self._db.execute("UPDATE deployments SET pending = ? WHERE name = ?", (text, name))

    def pending_switch(self, name: str) -> tuple[int, int] | None:
        row = self._db.execute("SELECT pending FROM deployments WHERE name = ?", (name,)).fetchone()
        if not row or row[0] is None:
            return None
        revision, percent = json.loads(row[0])
        return int(revision), int(percent)

    def traffic(self, name: str) -> dict[int, int]:
        row = self._db.execute("SELECT traffic FROM deployments WHERE name = ?", (name,)).fetchone()
        return {int(k): int(v) for k, v in json.loads(row[0] or "{}").items()} if row else {}

    def revisions(self, name: str) -> list[tuple[DeploymentSpec, float]]:
        """Every revision of `name`, oldest first, with when it was created (epoch seconds)."""
        rows = self._db.execute(
            "SELECT spec, created_at FROM revisions WHERE name = ? ORDER BY revision", (name,)
        ).fetchall()
        return [(_spec(text), created) for text, created in rows]

    def revision(self, name: str, number: int) -> DeploymentSpec | None:
        row = self._db.execute(
            "SELECT spec FROM revisions WHERE name = ? AND revision = ?", (name, number)
        ).fetchone()
        return _spec(row[0]) if row else None

    async def delete(self, name: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM deployments WHERE name = ?", (name,))
            self._db.execute("DELETE FROM revisions WHERE name = ?", (name,))

    def all(self) -> list[DeploymentSpec]:
        """Each deployment's newest revision."""
        rows = self._db.execute("SELECT spec FROM deployments ORDER BY created_at, name").fetchall()
        return [_spec(text) for (text,) in rows]

    def serving(self) -> list[DeploymentSpec]:
        """Every revision that has traffic: what `stoker up` brings back."""
        out = []
        for name, traffic in self._db.execute(
            "SELECT name, traffic FROM deployments ORDER BY created_at, name"
        ):
            for number in sorted(int(k) for k, v in json.loads(traffic or "{}").items() if v > 0):
                if (spec := self.revision(name, number)) is not None:
                    out.append(spec)
        return out

    def close(self) -> None:
        self._db.close()


def _spec(text: str) -> DeploymentSpec:
    """A stored spec; fields a later version dropped are ignored, fields it added take defaults."""
    return DeploymentSpec.from_dict(json.loads(text))


def _traffic_json(traffic: dict[int, int] | None) -> str | None:
    return None if traffic is None else json.dumps({str(k): v for k, v in sorted(traffic.items())})
