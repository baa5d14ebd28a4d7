"""One deployment's snapshot in this machine's page cache: where a start would load from now
(measured at most every `TIER_TTL_S`: it reads every file's page residency), and a warm the policy
asks for (at most one a minute, in the background, one at a time)."""

from __future__ import annotations

import asyncio
import logging

from snapshots import SnapshotError, WarmReport, pagecache
from warm_pool.errors import PoolError
from warm_pool.policies.base import Tier
from warm_pool.snapshot import SnapshotSource

log = logging.getLogger("stoker.pool")
TIER_TTL_S = 5.0  # how long a measured snapshot tier (mincore over its files) is trusted
WARM_EVERY_S = 60.0  # at most one page-cache warm a minute, if the cache cannot keep the snapshot


class PageTier:
    def __init__(self, deployment: str, snapshot: SnapshotSource) -> None:
        self.deployment = deployment
        self.snapshot = snapshot
        self._seen: tuple[float, Tier] | None = None  # (when, tier) of the last measurement
        self._warming: asyncio.Future[WarmReport] | None = None  # the warm in flight
        self._asked_at = -WARM_EVERY_S
        self._background: set[asyncio.Task] = set()

    def tier(self, now: float) -> Tier:
        if self._seen is None or now - self._seen[0] >= TIER_TTL_S:
            self._seen = (now, self.snapshot.tier())
        return self._seen[1]

    async def warm(self) -> WarmReport:
        """Read the snapshot's files into the page cache, so the next start loads at memory speed.
        One warm at a time: a call while one runs awaits that one's report."""
        if self._warming is None or self._warming.done():
            self._warming = asyncio.ensure_future(asyncio.to_thread(self._warm))
        # A caller that gives up must not cancel the warm the others await (the thread runs on anyway).
        return await asyncio.shield(self._warming)

    def warm_in_background(self, now: float) -> None:
        if now - self._asked_at < WARM_EVERY_S or not self.snapshot.is_local():
            return  # recently asked, or nothing local to read (a start pulls it first)
        self._asked_at = now
        task = asyncio.create_task(self._warm_quietly(), name=f"warm-{self.deployment}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _warm(self) -> WarmReport:
        try:
            report = pagecache.warm(self.snapshot.path)
        except SnapshotError as exc:
            raise PoolError(f"pool {self.deployment}: cannot warm its snapshot: {exc}") from exc
        log.info(
            "pool %s: snapshot in the page cache, %d bytes in %.2fs",
            self.deployment,
            report.bytes,
            report.seconds,
        )
        return report

    async def _warm_quietly(self) -> None:
        try:
            await self.warm()
        except PoolError as exc:
            log.warning("%s", exc)
        finally:
            self._seen = None  # measure again at the next tick
