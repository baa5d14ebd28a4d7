"""API keys and who is calling: the gateway's middleware that resolves a request's bearer key to a
`Principal`, from wherever the keys are (`KeyLookup`; the SQLite store is `stoker.control.keys`).

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

import hmac
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from stoker.errors import error_response, unauthorized
from stoker.spec.keys import ADMIN, NO_LIMITS, KeyRecord, Limits, Principal

OPEN_PATHS = frozenset({"/healthz", "/openapi.json"})  # no key needed
SCOPE_KEY = "stoker.principal"  # where `KeyAuth` leaves the caller in the ASGI scope


class KeyLookup(Protocol):
    """What `KeyAuth` needs of where tenant keys are: `stoker.control.keys.KeyStore` (the SQLite
    table, in `stoker up` and `stoker controller`) or a gateway's table of the controller's hashes
    (`stoker.gateway.plane.KeyTable`)."""

    def __len__(self) -> int: ...

    def lookup(self, key: str) -> KeyRecord | None: ...


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
        store: KeyLookup,
        open_paths: frozenset[str] = OPEN_PATHS,  # and the dashboard's page: `middleware_for`
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


@dataclass(frozen=True)
class Access:
    """Who may call what: the admin key (None: none set), the tenant keys, the origins the admin
    API accepts browser requests from, the limits of keys that set none of their own, and the
    `Host` names served while no admin key is set (None: any; `stoker.http.HostGuard`)."""

    admin_key: str | None
    keys: Any  # a `stoker.control.keys.KeyStore`; in a gateway of its own, its `KeyTable`
    origins: frozenset[str]
    default_limits: Limits = NO_LIMITS
    hosts: frozenset[str] | None = None
