"""API keys and who is calling: the key store (SQLite), and the gateway's middleware that resolves a
request's bearer key to a `Principal`.

Two kinds of caller hold a key:

- the admin, whose key is `STOKER_ADMIN_KEY` (never stored: the operator holds it); it may call the
  admin API and every deployment;
- a tenant, whose key was made by `stoker keys create` and may call only the deployments named
  on it. Any other deployment answers exactly as a non-existent one does (404 `model_not_found`),
  so a key learns nothing about what else is deployed.

The platform runs open (everyone is the admin) only while there is no admin key and no tenant key.
Keys are `sk-stoker-` and 32 random bytes (secrets.token_urlsafe), shown once, stored as their
SHA-256. A fast unsalted hash is right here: it protects passwords because they are guessable, and a
256-bit random key is not, so a stolen table gives nothing to brute-force. A lookup hashes the
given key and finds the hash in a dict: the timing of that says nothing about any stored key.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from stoker.api.dashboard import OPEN_PATHS as DASHBOARD_PATHS
from stoker.control.registry import NAME
from stoker.errors import APIError, error_response, invalid, unauthorized
from stoker.gateway.limits import NO_LIMITS, Limits

PREFIX = "sk-stoker-"
SCOPE_KEY = "stoker.principal"  # where `KeyAuth` leaves the caller in the ASGI scope
TENANT = NAME  # same alphabet as deployment names: safe in logs, tables and URLs


@dataclass(frozen=True)
class KeyRecord:
    id: str
    tenant: str
    deployments: tuple[str, ...]
    created: float  # unix seconds
    limits: Limits = NO_LIMITS  # its own; the platform's defaults apply where these say nothing

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "deployments": list(self.deployments),
            "created": self.created,
            **self.limits.to_dict(),
        }

    @functools.cached_property
    def principal(self) -> Principal:
        return Principal(False, self.tenant, frozenset(self.deployments), self.id, self.limits)


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: the admin (may call everything) or a tenant's key."""

    admin: bool
    tenant: str | None = None
    deployments: frozenset[str] = frozenset()
    key_id: str = "admin"  # the key's id: whose limits, and whose turn in a hold queue
    limits: Limits = NO_LIMITS

    def may_call(self, deployment: str) -> bool:
        return self.admin or deployment in self.deployments


ADMIN = Principal(admin=True)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


KEY_FIELDS = ("tenant", "deployments", "rps", "tpm", "max_concurrent")


def validate_key_request(body: Any) -> tuple[str, tuple[str, ...], Limits]:
    """A `POST /admin/v1/keys` body: `{"tenant": str, "deployments": [name, ...]}` and optional
    limits `rps`, `tpm`, `max_concurrent`; or a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(KEY_FIELDS))
    if unknown:
        raise invalid(f"Unknown field(s) {unknown}; allowed: {', '.join(KEY_FIELDS)}.", unknown[0])
    tenant = body.get("tenant")
    if not isinstance(tenant, str) or not TENANT.fullmatch(tenant):
        raise invalid(
            f"'tenant' must be 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit; got {tenant!r}.",
            "tenant",
        )
    names = body.get("deployments")
    if not isinstance(names, list) or not names or len(names) > 1024:
        raise invalid("'deployments' must be a list of 1 to 1024 deployment names.", "deployments")
    for name in names:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid(f"'deployments' holds {name!r}, which is no deployment name.", "deployments")
    return tenant, tuple(dict.fromkeys(names)), Limits.parse(body)


class KeyStore:
    """Tenant keys in SQLite (the registry's `stoker.db`, table `api_keys`), mirrored in memory so
    that the request path never touches the database. One process owns the file."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
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

    def create(
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

    def revoke(self, key_id: str) -> KeyRecord:
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


class KeyAuth:
    """Pure ASGI middleware: resolves `Authorization: Bearer KEY` to a `Principal`, left in the scope
    under `SCOPE_KEY`, or answers 401 in OpenAI's shape. The body is never read before the check.

    - `open_paths` (`/healthz`, `/openapi.json`, the dashboard's page and script, which hold no
      data: `stoker.api.dashboard`) are served to anyone;
    - `admin_prefixes` (`/admin/`, `/metrics`) take the admin key only;
    - everything else takes the admin key or a tenant key.

    Open mode (no admin key, no tenant key): every caller is the admin. With tenant keys but no
    admin key (keys made before the admin key was unset), the data path takes tenant keys and the
    admin API stays as open as it was: `stoker up` refuses a non-loopback bind without an admin key.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        admin_key: str | None,
        store: KeyStore,
        open_paths: frozenset[str] = frozenset({"/healthz", "/openapi.json"}) | DASHBOARD_PATHS,
        admin_prefixes: tuple[str, ...] = ("/admin/", "/metrics"),
    ) -> None:
        self.app = app
        self._admin = b"Bearer " + admin_key.encode() if admin_key else None
        self.store = store
        self.open_paths = open_paths
        self.admin_prefixes = admin_prefixes

    def is_open(self) -> bool:
        return self._admin is None and len(self.store) == 0

    def principal(self, authorization: bytes, *, admin_only: bool) -> Principal | None:
        if self._admin is None and (admin_only or len(self.store) == 0):
            return ADMIN
        if self._admin is not None and hmac.compare_digest(authorization, self._admin):
            return ADMIN
        if admin_only or not authorization.startswith(b"Bearer "):
            return None
        record = self.store.lookup(authorization[len(b"Bearer ") :].decode("latin-1"))
        if record is None:
            return None
        return record.principal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        admin_only = scope["path"].startswith(self.admin_prefixes)
        principal = self.principal(given, admin_only=admin_only)
        if principal is None:
            message = "This route takes the admin key (STOKER_ADMIN_KEY)." if admin_only else None
            await error_response(unauthorized(message) if message else unauthorized())(scope, receive, send)
            return
        scope[SCOPE_KEY] = principal
        await self.app(scope, receive, send)


def principal_of(scope: Scope) -> Principal:
    """The caller `KeyAuth` found; the admin where no `KeyAuth` runs (a gateway built without one)."""
    return scope.get(SCOPE_KEY, ADMIN)
