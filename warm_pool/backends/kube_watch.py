"""The Kubernetes backend's view of its pods: list, then watch from the list's version (on 410
Gone or a broken stream, list again), kept in memory so that whether a pod lives is a dict lookup,
and the last states of deleted pods kept a while for their exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import httpx2
from lightkube import ApiError, AsyncClient
from lightkube.resources.core_v1 import Pod

from warm_pool.errors import PoolError

log = logging.getLogger("warm_pool.kube")
GONE_KEPT = 1024  # last states of deleted pods kept for `stop`'s exit code


class Handle(Protocol):
    pod: str
    uid: str


class PodWatch:
    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        labels: dict[str, str],
        *,
        retry_s: float,
        sync_timeout_s: float,
        on_ended: Callable[[str], None],
    ) -> None:
        self._client, self.namespace, self._labels = client, namespace, labels
        self._retry_s, self._sync_timeout_s, self._on_ended = retry_s, sync_timeout_s, on_ended
        self.pods: dict[str, Pod] = {}  # by name: this owner's pods as last seen
        self.gone: OrderedDict[str, Pod] = OrderedDict()  # by uid: last state of deleted pods
        self._changed = asyncio.Condition()
        self._synced = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.error = "not listed yet"  # what the last failed list or watch said

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def ensure(self) -> None:
        """Start the watch if need be and wait for its first list; PoolError if the API does not
        answer in `sync_timeout_s` (the watch keeps trying)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kube-watch-{self.namespace}")
        try:
            await asyncio.wait_for(self._synced.wait(), self._sync_timeout_s)
        except TimeoutError:
            raise PoolError(f"cannot list pods in namespace {self.namespace} ({self.error})") from None

    async def _run(self) -> None:
        """List, then watch from the list's version; on 410 Gone or a broken stream, list again."""
        while True:
            try:
                version = await self._relist()
                watch = self._client.watch(
                    Pod, namespace=self.namespace, labels=self._labels, resource_version=version
                )
                async for event, pod in watch:
                    await self._apply(event, pod)
            except ApiError as exc:
                if exc.status.code != 410:
                    self.error = f"{exc.status.code} {exc.status.reason}: {exc.status.message}"
                    log.warning("watching pods in %s: %s; listing again", self.namespace, self.error)
                    await asyncio.sleep(self._retry_s)
            except (httpx2.HTTPError, OSError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("watching pods in %s: %s; listing again", self.namespace, self.error)
                await asyncio.sleep(self._retry_s)

    async def _relist(self) -> str:
        listing = self._client.list(Pod, namespace=self.namespace, labels=self._labels)
        pods = {pod.metadata.name: pod async for pod in listing}
        version = listing.resourceVersion
        # A pod `start` created after the list was taken is newer than it: kept, its events follow.
        # (Versions are compared only here, between a list and an object from the same server.)
        newer = {
            n: p
            for n, p in self.pods.items()
            if n not in pods and int(p.metadata.resourceVersion) > int(version)
        }
        for name, pod in self.pods.items():
            if name not in pods and name not in newer:
                self._forget(pod)
        self.pods = {**pods, **newer}
        self._synced.set()
        async with self._changed:
            self._changed.notify_all()
        return version

    async def _apply(self, event: str, pod: Pod) -> None:
        if event == "DELETED":
            current = self.pods.get(pod.metadata.name)
            if current is not None and current.metadata.uid == pod.metadata.uid:
                del self.pods[pod.metadata.name]
            self._forget(pod)
        else:
            self.remember(pod)
            if pod.status is not None and pod.status.phase in ("Failed", "Succeeded"):
                self._on_ended(pod.metadata.name)  # read it while the pod is still there
        async with self._changed:
            self._changed.notify_all()

    def remember(self, pod: Pod) -> None:
        self.pods[pod.metadata.name] = pod

    def _forget(self, pod: Pod) -> None:
        self.gone[pod.metadata.uid] = pod
        while len(self.gone) > GONE_KEPT:
            self.gone.popitem(last=False)

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), max(0.0, timeout_s))
            except TimeoutError:
                return False
        return True

    def gone_now(self, handle: Handle) -> bool:
        pod = self.pods.get(handle.pod)
        return pod is None or pod.metadata.uid != handle.uid
