"""Leader election on a Kubernetes Lease (coordination.k8s.io/v1), as client-go's leaderelection
does it: of several controller replicas exactly one runs the control loops at a time.

    candidate ──lease free or expired: replace it, naming us (resourceVersion guards the write)──▶ leader
    leader ──renew every renew_s──▶ leader
    leader ──no successful renew for renew_deadline_s, or someone else holds it──▶ stops leading

Whether another holder's lease has expired is judged on our own monotonic clock, from when we last
saw its record change (`renewTime` or holder), never by comparing its timestamps with our wall
clock: clocks of two machines disagree, durations measured on one do not. A leader steps down after
`renew_deadline_s` without a renewal, which is shorter than the `lease_s` others wait before they
take over, so two leaders never act at once while both clocks run at the same rate.

Every write is a replace carrying the resourceVersion that was read: of two candidates that saw
the same expired lease, one write wins and the other gets 409 Conflict and stays a candidate.

Use: `await LeaderElector(client, ns, "stoker-controller", pod_name).run(lead, stopped)`: `lead()`
runs while this replica leads and is cancelled when it stops leading; then `stopped()` is awaited
and `run` returns (a replica that lost the lease starts over from nothing: the caller exits or
calls `run` again). `is_leader` tells at any moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import httpx2
from lightkube import ApiError, AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from warm_pool.backends.kube_access import calls

log = logging.getLogger(__name__)


class LeaderElector:
    # Every call the election makes (a read, then a create or a replace); the chart grants these.
    API_CALLS = calls("coordination.k8s.io", "leases", "get", "create", "update")

    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_s: float = 15.0,
        renew_s: float = 5.0,
        renew_deadline_s: float | None = None,
        release_on_exit: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`renew_deadline_s` defaults to `lease_s - renew_s`; it must lie between the two. With
        `release_on_exit` a leader that stops by itself (cancelled, or `lead()` returned) clears the
        holder, so the next replica need not wait out the lease."""
        deadline = lease_s - renew_s if renew_deadline_s is None else renew_deadline_s
        if not 0 < renew_s < deadline < lease_s:
            raise ValueError(
                f"need 0 < renew_s < renew_deadline_s < lease_s, got {renew_s:g}, {deadline:g}, {lease_s:g}"
            )
        self._client = client
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_s, self.renew_s, self.renew_deadline_s = lease_s, renew_s, deadline
        self._release_on_exit = release_on_exit
        self._clock = clock
        self._wall_clock = wall_clock
        self._observed: tuple[str | None, object] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0  # our clock when that record was first seen
        self._renewed_at: float | None = None  # our clock at our last successful write; None: not leading

    @property
    def is_leader(self) -> bool:
        return self._renewed_at is not None and self._clock() - self._renewed_at < self.renew_deadline_s

    async def run(
        self,
        on_started_leading: Callable[[], Awaitable[None]],
        on_stopped_leading: Callable[[], Awaitable[None]],
    ) -> None:
        """Become leader (trying every `renew_s`), run `on_started_leading()` while leading, and
        return once this replica stopped leading, after `on_stopped_leading()`."""
        # A Lease has no "wait until free": candidates poll it, as client-go's do.
        while not await self._try_acquire_or_renew():  # noqa: ASYNC110
            await asyncio.sleep(self.renew_s)
        log.info("%s leads %s/%s", self.identity, self.namespace, self.name)
        lead = asyncio.create_task(on_started_leading())
        renew = asyncio.create_task(self._keep_renewing())
        try:
            await asyncio.wait({lead, renew}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost = renew.done()  # renewing gave up: the lease may be another's now, so no release
            self._renewed_at = None
            for task in (lead, renew):
                task.cancel()
            await asyncio.gather(lead, renew, return_exceptions=True)
            if self._release_on_exit and not lost:
                await self._release()
            log.info("%s stopped leading %s/%s", self.identity, self.namespace, self.name)
            await on_stopped_leading()
        if lead.done() and not lead.cancelled() and lead.exception() is not None:
            raise lead.exception()  # type: ignore[misc]

    async def _keep_renewing(self) -> None:
        """Renew every `renew_s`; return (leadership lost) when renewing has failed for
        `renew_deadline_s`, or another holder took the lease."""
        while True:
            await asyncio.sleep(self.renew_s)
            assert self._renewed_at is not None
            remaining = self.renew_deadline_s - (self._clock() - self._renewed_at)
            try:
                renewed = await asyncio.wait_for(self._try_acquire_or_renew(), max(0.0, remaining))
            except TimeoutError:
                renewed = False
            if renewed:
                continue
            if self._observed is not None and self._observed[0] not in (self.identity, None, ""):
                log.warning(
                    "%s lost %s/%s to %s", self.identity, self.namespace, self.name, self._observed[0]
                )
                return
            if self._clock() - self._renewed_at >= self.renew_deadline_s:
                log.warning(
                    "%s could not renew %s/%s in %gs",
                    self.identity,
                    self.namespace,
                    self.name,
                    self.renew_deadline_s,
                )
                return

    async def _try_acquire_or_renew(self) -> bool:
        """One read and, if the lease is ours to take or keep, one write. True if we hold it now."""
        try:
            lease = await self._client.get(Lease, self.name, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                return self._failed("read", exc.status.message)
            return await self._write(None)
        except (httpx2.HTTPError, OSError) as exc:
            return self._failed("read", str(exc))
        spec = lease.spec or LeaseSpec()
        self._observe(spec)
        holder = spec.holderIdentity
        if holder not in (None, "", self.identity) and not self._expired(spec):
            return False
        return await self._write(lease)

    def _observe(self, spec: LeaseSpec) -> None:
        record = (spec.holderIdentity, spec.renewTime)
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()

    def _expired(self, spec: LeaseSpec) -> bool:
        duration = spec.leaseDurationSeconds or self.lease_s
        return self._clock() - self._observed_at >= duration

    async def _write(self, lease: Lease | None) -> bool:
        now = self._wall_clock()
        spec = LeaseSpec(
            holderIdentity=self.identity,
            leaseDurationSeconds=math.ceil(self.lease_s),  # others wait at least lease_s
            acquireTime=now,
            renewTime=now,
            leaseTransitions=0,
        )
        started = self._clock()
        try:
            if lease is None:
                await self._client.create(
                    Lease(metadata=ObjectMeta(name=self.name), spec=spec), namespace=self.namespace
                )
            else:
                old = lease.spec or LeaseSpec()
                ours = old.holderIdentity == self.identity
                spec.acquireTime = old.acquireTime if ours and old.acquireTime else now
                spec.leaseTransitions = (old.leaseTransitions or 0) + (
                    0 if ours or not old.holderIdentity else 1
                )
                lease.spec = spec
                await self._client.replace(lease, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code in (409,):  # someone else wrote first: theirs, this round
                return False
            return self._failed("write", exc.status.message)
        except (httpx2.HTTPError, OSError) as exc:
            return self._failed("write", str(exc))
        self._observed, self._observed_at = (self.identity, now), started
        self._renewed_at = started
        return True

    async def _release(self) -> None:
        """Clear the holder so that the next candidate need not wait for the lease to expire."""
        with contextlib.suppress(ApiError, httpx2.HTTPError, OSError):
            lease = await self._client.get(Lease, self.name, namespace=self.namespace)
            if lease.spec is not None and lease.spec.holderIdentity == self.identity:
                lease.spec.holderIdentity = None
                lease.spec.leaseDurationSeconds = 1
                await self._client.replace(lease, namespace=self.namespace)

    def _failed(self, what: str, message: str) -> bool:
        log.warning(
            "%s could not %s lease %s/%s: %s", self.identity, what, self.namespace, self.name, message
        )
        return False
