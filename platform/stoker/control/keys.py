"""Tenant keys' store: SQLite (the registry's `stoker.db`, table `api_keys`), mirrored in memory so
that the request path never touches the database. Keys are made, listed and revoked through the
admin API (`stoker.api.deployments`); what a key is and how a request's key is checked is
`stoker.gateway.keys`'.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoker.errors import APIError
from stoker.paths import open_database
from stoker.spec.keys import NO_LIMITS, PREFIX, KeyRecord, Limits, hash_key


class KeyStore:
    """Tenant keys in SQLite (the registry's `stoker.db`, table `api_keys`), mirrored in memory so
    that the request path never touches the database. One process owns the file."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self._db = open_database(path)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS api_keys (id TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE,"
            " tenant TEXT NOT NULL, deployments TEXT NOT NULL, created_at REAL NOT NULL,"
            " limits TEXT NOT NULL DEFAULT '{}')"
        )
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(api_keys)")}
        if "limits" not in columns:  # a store made before keys had limits
            self._db.execute("ALTER TABLE api_keys ADD COLUMN limits TEXT NOT NULL DEFAULT '{}'")
        self._clock = clock
        self._by_hash: dict[str, KeyRecord] = {}
        rows = self._db.execute(
            "SELECT id, key_hash, tenant, deployments, created_at, limits FROM api_keys"
            " ORDER BY created_at, id"
        )
        for id_, key_hash, tenant, deployments, created, limits in rows:
            record = KeyRecord(
                id_, tenant, tuple(json.loads(deployments)), created, Limits(**json.loads(limits))
            )
            self._by_hash[key_hash] = record

    def __len__(self) -> int:
        return len(self._by_hash)

    async def create(
        self, tenant: str, deployments: tuple[str, ...], limits: Limits = NO_LIMITS
    ) -> tuple[KeyRecord, str]:
        """A new key for `tenant`; returns its record and the key itself, which is not kept."""
        key = PREFIX + secrets.token_urlsafe(32)
        record = KeyRecord("key_" + secrets.token_hex(8), tenant, deployments, self._clock(), limits)
        with self._db:
            self._db.execute(
                "INSERT INTO api_keys (id, key_hash, tenant, deployments, created_at, limits)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    hash_key(key),
                    tenant,
                    json.dumps(list(deployments)),
                    record.created,
                    json.dumps(limits.to_dict()),
                ),
            )
        self._by_hash[hash_key(key)] = record
        return record, key

    def all(self) -> list[KeyRecord]:
        return sorted(self._by_hash.values(), key=lambda r: (r.created, r.id))

    async def revoke(self, key_id: str) -> KeyRecord:
        for key_hash, record in self._by_hash.items():
            if record.id == key_id:
                with self._db:
                    self._db.execute("DELETE FROM api_keys WHERE id = ?", (key_id,))
                del self._by_hash[key_hash]
                return record
        raise APIError(
            404, f"No key with id {key_id!r}.", type="not_found_error", param="id", code="key_not_found"
        )

    def lookup(self, key: str) -> KeyRecord | None:
        return self._by_hash.get(hash_key(key))

    def hashed(self) -> list[dict[str, Any]]:
        """Every key as a gateway needs it: its record and the SHA-256 of the key, never the key."""
        return [{**r.to_dict(), "hash": h} for h, r in self._by_hash.items()]

    def close(self) -> None:
        self._db.close()
