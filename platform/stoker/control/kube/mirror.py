"""A kind's objects in one namespace as the API server last said, kept by a list and a watch (an
informer, as client-go calls it): the controller's stores read this copy, never the API server, so
a request or a reconcile never waits on a round trip, and a standby replica keeps it warm before it
leads (`stoker.serve.controller`).

    list ──▶ objects, synced ──watch from the list's version──▶ ADDED/MODIFIED/DELETED ──▶ objects, on_change(name)
      ▲                                                           │ 410 Gone, a broken stream
      └───────────────────────────────────────────────────────────┘ (after `retry_s` unless 410)

Objects are plain dicts, as the API server sends them. A write of our own puts the answer here at
once (`put`), so the next write carries its resourceVersion; an event older than what is held (a
smaller resourceVersion: comparable within one server's objects of a kind, which is all this
compares) does not replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx2
from lightkube import ApiError, AsyncClient

log = logging.getLogger("stoker.kube")


def _version(obj: dict[str, Any]) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:
        return 0


class Mirror:
    """`resource`: a lightkube resource class (a generic one for a custom resource); `labels`: only
    the objects with these. `on_change(name)` is called for each object that changed or went."""

    def __init__(
        self,
        client: AsyncClient,
        resource: type,
        namespace: str,
        *,
        labels: dict[str, str] | None = None,
        retry_s: float = 1.0,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._client, self._resource, self.namespace = client, resource, namespace
        self._labels = labels
        self._retry_s = retry_s
        self.on_change = on_change
        self.objects: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.error = "not listed yet"  # what the last failed list or watch said
        self._task: asyncio.Task | None = None

    @property
    def what(self) -> str:
        return f"{self._resource.__name__} in {self.namespace}"

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mirror-{self._resource.__name__}")

    async def wait_synced(self, timeout_s: float) -> None:
        """Until the first list is in; TimeoutError naming why not."""
        try:
            await asyncio.wait_for(self.synced.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"cannot list {self.what} ({self.error})") from None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def get(self, name: str) -> dict[str, Any] | None:
        return self.objects.get(name)

    def put(self, obj: dict[str, Any]) -> None:
        """An object as a write of ours was answered."""
        self._take(obj)

    def forget(self, name: str) -> None:
        if self.objects.pop(name, None) is not None:
            self._changed(name)

    async def _run(self) -> None:
        while True:
            try:
                version = await self._relist()
                watch = self._client.watch(
                    self._resource, namespace=self.namespace, labels=self._labels, resource_version=version
                )
                async for event, obj in watch:
                    raw = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
                    if event == "DELETED":
                        current = self.objects.get(raw["metadata"]["name"])
                        if current is not None and current["metadata"].get("uid") == raw["metadata"].get(
                            "uid"
                        ):
                            self.forget(raw["metadata"]["name"])
                    else:
                        self._take(raw)
            except ApiError as exc:
                if exc.status.code != 410:  # 410: the version is too old; list again at once
                    self.error = f"{exc.status.code} {exc.status.reason}: {exc.status.message}"
                    log.warning("watching %s: %s; listing again", self.what, self.error)
                    await asyncio.sleep(self._retry_s)
            except (httpx2.HTTPError, OSError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("watching %s: %s; listing again", self.what, self.error)
                await asyncio.sleep(self._retry_s)

    async def _relist(self) -> str:
        listing = self._client.list(self._resource, namespace=self.namespace, labels=self._labels)
        found = {}
        async for obj in listing:
            raw = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
            found[raw["metadata"]["name"]] = raw
        version = listing.resourceVersion
        for name in list(self.objects):
            if name not in found and _version(self.objects[name]) <= int(version or 0):
                self.forget(name)
        for obj in found.values():
            self._take(obj)
        self.synced.set()
        return version

    def _take(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        current = self.objects.get(name)
        if current is not None and current["metadata"].get("uid") == obj["metadata"].get("uid"):
            if _version(obj) < _version(current):
                return  # an event older than what a write of ours already put here
            if _version(obj) == _version(current):
                return
        self.objects[name] = obj
        self._changed(name)

    def _changed(self, name: str) -> None:
        if self.on_change is not None:
            self.on_change(name)
