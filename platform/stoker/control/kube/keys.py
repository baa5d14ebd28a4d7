"""Tenant keys in the API server, for a cluster's controller: the SQLite `KeyStore`'s interface
(`stoker.control.keys`) over one Secret per key in the controller's namespace.

    apiVersion: v1
    kind: Secret
    type: stoker.dev/api-key
    metadata:
      name: stoker-key-<suffix>          # the key's id is key_<suffix>
      labels:
        stoker.dev/key: "true"           # what makes it a key: the store watches this label
        app.kubernetes.io/managed-by: stoker    # on those the controller made
    stringData:                          # (the API server keeps it as base64 `data`)
      hash: <the SHA-256 of the key, 64 lowercase hex digits>     # never the key
      tenant: acme
      deployments: '["chat", "summarise"]'                        # JSON, 1 to 1024 names
      limits: '{"rps": 5, "tpm": 20000, "max_concurrent": 4}'     # JSON, optional (default: none);
                                         # also priority, priority_min: the key's priority class
      created: "1767225600.0"            # unix seconds, optional (default: the Secret's creation)

Why a Secret and not a custom resource, as deployments and routes are: the hash verifies a
credential (anyone holding it can check a guessed key offline, and a leaked table names every
tenant), and Kubernetes treats Secrets as such where it does not treat custom resources so: the
built-in `view` ClusterRole and most read-only access (dashboards, support accounts, `kubectl get
all`-style tooling) exclude Secrets, while custom resources are commonly readable by everyone with
read access to the namespace; Secrets can be encrypted at rest (an `EncryptionConfiguration`
provider on the API server); and the GitOps tools made for credentials (Sealed Secrets, External
Secrets) produce Secrets, so a team can declare a key in Git as its hash, in the shape above, and
hand the key itself to the tenant out of band.

A Secret applied with the label and these fields is a key like one `stoker keys create` made. One
with the label whose fields are malformed (a bad hash, tenant, deployment name, limit or name) is
logged once (per version) and ignored, never a crash; a second Secret with a hash another already
holds is ignored likewise (the older one keeps it; a revoke deletes both).

Reads come from a `Mirror` of the labelled Secrets, indexed by hash, so `lookup` on the request
path is a dict lookup. `create` and `revoke` write the API server and put the answer in the mirror
at once; `on_change` (the routing table's bump) hears of every change, ours or someone else's, so
that the gateways' copies of the hashes follow.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple

from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret

from stoker.control.kube.errors import refused
from stoker.control.kube.kinds import MANAGED
from stoker.control.kube.mirror import Mirror
from stoker.errors import APIError
from stoker.spec.deployment import NAME
from stoker.spec.keys import LIMIT_FIELDS, NO_LIMITS, PREFIX, TENANT, KeyRecord, Limits, hash_key
from warm_pool.backends.kube_access import calls

log = logging.getLogger("stoker.kube")

KEY_LABEL = "stoker.dev/key"
SECRET_TYPE = "stoker.dev/api-key"
NAME_PREFIX = "stoker-key-"
ID_PREFIX = "key_"
_HASH = re.compile(r"[0-9a-f]{64}")


class Malformed(ValueError):
    """A labelled Secret that is no key: why."""


class _Key(NamedTuple):
    hash: str
    record: KeyRecord


def key_of(obj: dict[str, Any]) -> _Key:
    """The key a Secret declares (see the module), or Malformed saying why not."""
    name = obj["metadata"]["name"]
    if not name.startswith(NAME_PREFIX) or len(name) == len(NAME_PREFIX):
        raise Malformed(f"its name is not {NAME_PREFIX}<suffix>")
    if obj.get("type") != SECRET_TYPE:
        raise Malformed(f"its type is {obj.get('type')!r}, not {SECRET_TYPE!r}")
    data = {}
    for field, value in (obj.get("data") or {}).items():
        try:
            data[field] = base64.b64decode(value, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError, TypeError):
            raise Malformed(f"data[{field!r}] is not base64 of UTF-8 text") from None
    unknown = sorted(set(data) - {"hash", "tenant", "deployments", "limits", "created"})
    if unknown:
        raise Malformed(f"unknown data field(s) {unknown}")
    if not _HASH.fullmatch(data.get("hash", "")):
        raise Malformed("data.hash is not a SHA-256 in 64 lowercase hex digits")
    tenant = data.get("tenant", "")
    if not TENANT.fullmatch(tenant):
        raise Malformed(f"data.tenant {tenant!r} is no tenant name")
    try:
        deployments = json.loads(data.get("deployments", ""))
        limits = json.loads(data.get("limits", "{}"))
        created = float(data["created"]) if "created" in data else _epoch(obj)
    except ValueError as exc:
        raise Malformed(f"a field is not what it should be: {exc}") from None
    if (
        not isinstance(deployments, list)
        or not 1 <= len(deployments) <= 1024
        or not all(isinstance(d, str) and NAME.fullmatch(d) for d in deployments)
    ):
        raise Malformed("data.deployments is not a JSON list of 1 to 1024 deployment names")
    if not isinstance(limits, dict) or set(limits) - LIMIT_FIELDS:
        raise Malformed(f"data.limits is not a JSON object of {', '.join(sorted(LIMIT_FIELDS))}")
    try:
        parsed = Limits.parse(limits, "limits.")
    except APIError as exc:
        raise Malformed(exc.message) from None
    record = KeyRecord(
        ID_PREFIX + name[len(NAME_PREFIX) :], tenant, tuple(dict.fromkeys(deployments)), created, parsed
    )
    return _Key(data["hash"], record)


def _epoch(obj: dict[str, Any]) -> float:
    stamp = obj["metadata"].get("creationTimestamp")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def not_found(key_id: str) -> APIError:
    return APIError(
        404, f"No key with id {key_id!r}.", type="not_found_error", param="id", code="key_not_found"
    )


class SecretKeyStore:
    """Tenant keys as Secrets in `namespace` (see the module). `start()` the mirror and
    `wait_synced` before serving: until then it holds no key."""

    # Every call the store makes: the mirror's list and watch, a key's create and its revoke.
    API_CALLS = calls("", "secrets", "list", "watch", "create", "delete")

    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        *,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        retry_s: float = 1.0,
    ) -> None:
        self._client, self.namespace = client, namespace
        self._clock = clock
        self._on_change = on_change
        self._keys: dict[str, _Key | None] = {}  # by Secret name; None: malformed, ignored
        self._by_hash: dict[str, KeyRecord] = {}
        self._holder: dict[str, str] = {}  # hash → the Secret whose key it is
        self._mirror = Mirror(
            client, Secret, namespace, labels={KEY_LABEL: "true"}, retry_s=retry_s, on_change=self._changed
        )

    # ---- the mirror --------------------------------------------------------------------------

    def start(self) -> None:
        self._mirror.start()

    async def wait_synced(self, timeout_s: float) -> None:
        await self._mirror.wait_synced(timeout_s)

    async def aclose(self) -> None:
        await self._mirror.close()

    def close(self) -> None:
        """The platform's shutdown: the mirror closes with the controller (`aclose`)."""

    def _changed(self, name: str) -> None:
        obj = self._mirror.get(name)
        old = self._keys.pop(name, None)
        if obj is not None:
            try:
                self._keys[name] = key_of(obj)
            except Malformed as exc:  # once per version: the mirror calls this when one changed
                log.warning(
                    "Secret %s/%s is labelled %s but is no key, ignored: %s",
                    self.namespace,
                    name,
                    KEY_LABEL,
                    exc,
                )
                self._keys[name] = None
        if old is not None and self._holder.get(old.hash) == name:
            self._claim(old.hash)  # another Secret with that hash, if any, holds it now
        new = self._keys.get(name)
        if new is not None:
            self._claim(new.hash, name)
        if self._on_change is not None:
            self._on_change()

    def _claim(self, key_hash: str, candidate: str | None = None) -> None:
        """Who holds `key_hash`: of the Secrets holding it, the oldest. With a `candidate` (one just
        seen) only it and the holder compete; without, all are looked through (O(n): only when a
        holder changed or went)."""
        names = (
            [n for n in (self._holder.get(key_hash), candidate) if n is not None]
            if candidate is not None
            else [n for n, k in self._keys.items() if k is not None and k.hash == key_hash]
        )
        ranked = sorted(names, key=lambda n: (self._keys[n].record.created, n))  # type: ignore[union-attr]
        if not ranked:
            self._holder.pop(key_hash, None)
            self._by_hash.pop(key_hash, None)
            return
        self._holder[key_hash] = ranked[0]
        self._by_hash[key_hash] = self._keys[ranked[0]].record  # type: ignore[union-attr]
        if candidate is not None and len(set(ranked)) > 1:
            log.warning(
                "Secrets %s/%s hold one hash: %s, the older, keeps it",
                self.namespace,
                " and ".join(ranked),
                ranked[0],
            )

    # ---- the KeyStore's interface -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_hash)

    async def create(
        self, tenant: str, deployments: tuple[str, ...], limits: Limits = NO_LIMITS
    ) -> tuple[KeyRecord, str]:
        """A new key for `tenant`; returns its record and the key itself, which is not kept."""
        key, suffix = PREFIX + secrets.token_urlsafe(32), secrets.token_hex(8)
        record = KeyRecord(ID_PREFIX + suffix, tenant, deployments, self._clock(), limits)
        secret = Secret(
            metadata=ObjectMeta(
                name=NAME_PREFIX + suffix,
                namespace=self.namespace,
                labels={KEY_LABEL: "true", **MANAGED},
            ),
            type=SECRET_TYPE,
            data={
                "hash": _b64(hash_key(key)),
                "tenant": _b64(tenant),
                "deployments": _b64(json.dumps(list(deployments))),
                "limits": _b64(json.dumps(limits.to_dict())),
                "created": _b64(repr(record.created)),
            },
        )
        try:
            made = await self._client.create(secret, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 409:
                raise APIError(
                    409,
                    f"A Secret named {NAME_PREFIX + suffix!r} is there already ({exc.status.message}); "
                    "make the key again.",
                    code="conflict",
                ) from None
            raise refused(f"the key's Secret {NAME_PREFIX + suffix!r}", exc) from None
        self._mirror.put(made.to_dict())
        return record, key

    def all(self) -> list[KeyRecord]:
        return sorted(self._by_hash.values(), key=lambda r: (r.created, r.id))

    async def revoke(self, key_id: str) -> KeyRecord:
        """The key goes: its Secret deleted, and any other holding its hash (which would make it
        valid again)."""
        held = {h: n for h, n in self._holder.items() if self._by_hash[h].id == key_id}
        if not held:
            raise not_found(key_id)
        [(key_hash, _)] = held.items()
        record = self._by_hash[key_hash]
        for name in [n for n, k in self._keys.items() if k is not None and k.hash == key_hash]:
            try:
                await self._client.delete(Secret, name, namespace=self.namespace)
            except ApiError as exc:
                if exc.status.code != 404:  # 404: gone meanwhile, as asked
                    raise refused(f"the deletion of the key's Secret {name!r}", exc) from None
            self._mirror.forget(name)
        return record

    def lookup(self, key: str) -> KeyRecord | None:
        return self._by_hash.get(hash_key(key))

    def hashed(self) -> list[dict[str, Any]]:
        """Every key as a gateway needs it: its record and the SHA-256 of the key, never the key."""
        return [{**r.to_dict(), "hash": h} for h, r in self._by_hash.items()]
