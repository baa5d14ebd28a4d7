"""Checkpoints in the API server, for a cluster's controller (which has no volume): one ConfigMap
per kind in the controller's namespace,

    stoker-checkpoint-cost       stoker-checkpoint-history       stoker-checkpoint-policies

each labelled `app.kubernetes.io/managed-by: stoker` and `stoker.dev/checkpoint: <kind>`, holding
in `binaryData["checkpoint.json.gz"]` exactly what `FileCheckpointStore` writes to a file (the
envelope, `stoker.control.checkpoint.encode`), gzipped.

Bounded: the API server refuses a ConfigMap over 1 MiB (data and binaryData together), so a
checkpoint whose compressed bytes exceed that is refused here, before anything is sent, and the
previous one stays. Measured: a revision busy every minute of the day, its figures random, takes
~280 KiB of cost and ~59 KiB gzipped (4.7x; regular figures 12x), so the bound holds the cost of
some 17 such revisions, against the file store's 55. A read inflates at most `MAX_BYTES` (16 MiB,
the file store's bound): a gzip bomb is refused, not inflated.

Writes are guarded, never last-writer-wins: a write replaces the version of the ConfigMap this
store last read or wrote (its resourceVersion), so a replica that no longer leads, writing its last
checkpoint at shutdown after the new leader wrote its own, gets 409 Conflict and is refused
("changed by another writer"); the new leader's stays. A create where this store saw none is
refused likewise if one appeared meanwhile (409 AlreadyExists). A kind this store never read (its
read failed) is read first. A ConfigMap of that name that is not Stoker's (no labels) is neither
read nor ever overwritten; one that is Stoker's but cannot be trusted (bad gzip, bad JSON, another
format) is refused at the read and replaced at the next write, as a corrupt file is.

Calls block (lightkube's sync `Client`): `Checkpoints` makes them in threads.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import re
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx2
from lightkube import ApiError, Client, KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap

from stoker.control.checkpoint import MAX_BYTES, CheckpointRefused, decode, encode
from warm_pool.backends.kube_access import calls

MAX_CONFIGMAP_BYTES = 1 << 20  # what the API server takes of data and binaryData together
KEY = "checkpoint.json.gz"
MANAGED_BY = ("app.kubernetes.io/managed-by", "stoker")
KIND_LABEL = "stoker.dev/checkpoint"
_KIND = re.compile(r"[a-z][a-z0-9]{0,30}")  # a kind, as it goes into a ConfigMap's name


class _Seen(NamedTuple):
    """What this store last saw of a kind's ConfigMap: its resourceVersion (None: there was none),
    and whether it is Stoker's (a foreign one is never replaced)."""

    version: str | None
    ours: bool = True


_NONE = _Seen(None)


class ConfigMapCheckpointStore:
    """One gzipped ConfigMap per kind in `namespace` (see the module)."""

    # Every call the store makes: a read, then a create or a replace.
    API_CALLS = calls("", "configmaps", "get", "create", "update")

    def __init__(
        self,
        config_or_client: KubeConfig | Client,
        namespace: str,
        name_prefix: str = "stoker-checkpoint",
        *,
        max_bytes: int = MAX_CONFIGMAP_BYTES,
        timeout_s: float = 10.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._own_client = not isinstance(config_or_client, Client)
        self._client = (
            Client(config=config_or_client, namespace=namespace, timeout=httpx2.Timeout(timeout_s))
            if self._own_client
            else config_or_client
        )
        self.namespace = namespace
        self.name_prefix = name_prefix
        self.max_bytes = max_bytes
        self._wall = wall
        # By kind, from the last read or write. Set from the threads the calls run in, one call
        # at a time per kind (`Checkpoints` reads, then writes, each kind in turn).
        self._seen: dict[str, _Seen] = {}

    def name(self, kind: str) -> str:
        if not _KIND.fullmatch(kind):
            raise ValueError(f"a checkpoint kind is a plain lowercase name, got {kind!r}")
        return f"{self.name_prefix}-{kind}"

    def where(self, kind: str) -> str:
        return f"ConfigMap {self.namespace}/{self.name(kind)}"

    def close(self) -> None:
        if self._own_client:
            self._client.close()

    # ---- reading --------------------------------------------------------------------------------

    def read(self, kind: str) -> dict[str, Any] | None:
        found = self._get(kind)
        if found is None:
            return None
        if not self._seen[kind].ours:
            raise CheckpointRefused(
                f"not Stoker's checkpoint of {kind} (want the labels {MANAGED_BY[0]}={MANAGED_BY[1]}, "
                f"{KIND_LABEL}={kind}): left alone"
            )
        packed = (found.binaryData or {}).get(KEY)
        if packed is None or found.data:
            raise CheckpointRefused(f"not a checkpoint (want binaryData {KEY} alone)")
        try:
            compressed = base64.b64decode(packed, validate=True)
        except binascii.Error:
            raise CheckpointRefused(f"binaryData {KEY} is not base64") from None
        return decode(_gunzip(compressed), kind)

    def _get(self, kind: str) -> ConfigMap | None:
        """The ConfigMap of `kind` (its version and whether it is Stoker's kept in `_seen`); None if
        there is none."""
        try:
            found = self._client.get(ConfigMap, self.name(kind), namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                self._seen[kind] = _NONE
                return None
            raise CheckpointRefused(f"the API server refused the read: {exc.status.message}") from None
        except httpx2.HTTPError as exc:
            raise CheckpointRefused(f"cannot reach the API server: {type(exc).__name__}: {exc}") from None
        labels = found.metadata.labels or {}
        ours = labels.get(MANAGED_BY[0]) == MANAGED_BY[1] and labels.get(KIND_LABEL) == kind
        self._seen[kind] = _Seen(found.metadata.resourceVersion, ours)
        return found

    # ---- writing --------------------------------------------------------------------------------

    def write(self, kind: str, body: dict[str, Any]) -> None:
        name = self.name(kind)
        data = encode(kind, body, self._wall())
        if len(data) > MAX_BYTES:
            raise CheckpointRefused(
                f"{len(data)} bytes, over the bound of {MAX_BYTES}: not written (the previous one stays)"
            )
        packed = gzip.compress(data, compresslevel=6, mtime=0)
        if len(packed) > self.max_bytes:
            raise CheckpointRefused(
                f"{len(packed)} bytes gzipped ({len(data)} bytes), over a ConfigMap's bound of "
                f"{self.max_bytes}: not written (the previous one stays)"
            )
        if kind not in self._seen:  # never read (its read failed): read it now, for the version
            self._get(kind)
        version, ours = self._seen[kind]
        if not ours:
            raise CheckpointRefused(f"a ConfigMap {name} that is not Stoker's is there: not overwritten")
        obj = ConfigMap(
            metadata=ObjectMeta(
                name=name,
                namespace=self.namespace,
                labels={MANAGED_BY[0]: MANAGED_BY[1], KIND_LABEL: kind},
                resourceVersion=version,
            ),
            binaryData={KEY: base64.b64encode(packed).decode()},
        )
        try:
            written = self._client.create(obj) if version is None else self._client.replace(obj)
        except ApiError as exc:
            if exc.status.code == 409:
                raise CheckpointRefused(
                    f"changed by another writer since this replica {'read' if version else 'saw none'}"
                    f" ({exc.status.reason}): not written, theirs stays"
                ) from None
            if exc.status.code == 404:  # deleted meanwhile: the next write creates it
                self._seen[kind] = _NONE
                raise CheckpointRefused("deleted by another writer: not written this time") from None
            raise CheckpointRefused(f"the API server refused it: {exc.status.message}") from None
        except httpx2.HTTPError as exc:
            raise CheckpointRefused(f"cannot reach the API server: {type(exc).__name__}: {exc}") from None
        self._seen[kind] = _Seen(written.metadata.resourceVersion)


def _gunzip(compressed: bytes) -> bytes:
    """One gzip member, inflated to at most MAX_BYTES; CheckpointRefused otherwise."""
    inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        data = inflate.decompress(compressed, MAX_BYTES + 1)
    except zlib.error:
        raise CheckpointRefused("not gzip (truncated or corrupt)") from None
    if len(data) > MAX_BYTES:
        raise CheckpointRefused(f"over the bound of {MAX_BYTES} bytes, inflated")
    if not inflate.eof or inflate.unused_data:
        raise CheckpointRefused("not gzip (truncated, or bytes after its end)")
    return data
