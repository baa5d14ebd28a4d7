"""A deployment's snapshot as the pool sees it: made local before an instance starts, pinned while used.

A start never waits for a download it could have avoided: when the snapshot is in the local store
it is pinned and used as it is; only when it is not (never pulled, or evicted under the disk budget)
is it pulled from the object storage the deployment names, and every concurrent start shares that
one pull (the store's per-snapshot lock). The pin is held for the instance's life, so the store's
eviction and `stoker snapshot gc` never take the files from under a running engine.

`tier()` says where a start would load from right now (object storage, local disk, page cache):
the scaler's lead time depends on it.

Before a start uses the files, `SnapshotStore.check_for_start` compares every file's size with the
manifest, and its sha256 unless it is unchanged since it last hashed sound (a stat per file on the
usual start): a truncated or altered file fails the start with `SnapshotCorrupt` instead of an
engine that crashes at load, over and over.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from snapshots import CorruptSnapshot, SnapshotError, SnapshotNotFound, SnapshotStore, pagecache
from snapshots.pins import Pin
from snapshots.remote import PullReport, pull
from snapshots.s3 import RemoteConfig
from warm_pool.errors import PoolError, SnapshotCorrupt
from warm_pool.policies.base import Tier

# At least this much of the snapshot in the page cache counts as a start at memory speed.
RESIDENT_ENOUGH = 0.9


@dataclass(frozen=True)
class Acquired:
    path: Path
    pin: Pin
    tier: Tier  # where this start loads from
    pulled: PullReport | None  # the pull this start waited for, if any


@dataclass(frozen=True)
class SnapshotSource:
    store: SnapshotStore
    snapshot_id: str
    remote: str | None = None  # s3://bucket/prefix the snapshot can be pulled from
    remote_config: RemoteConfig | None = None

    @property
    def path(self) -> Path:
        return self.store.path_of(self.snapshot_id)

    def is_local(self) -> bool:
        return self.path.is_dir()

    def tier(self) -> Tier:
        """Where a fresh instance would load the snapshot from now."""
        if not self.is_local():
            return Tier.OBJECT_STORAGE
        try:
            resident = pagecache.residency(self.path)
        except SnapshotError:
            return Tier.DISK
        return Tier.PAGE_CACHE if resident >= RESIDENT_ENOUGH else Tier.DISK

    async def acquire(self, holder: str) -> Acquired:
        """Pin the snapshot for `holder`, pulling it first if it is not local, and check its files.

        PoolError if it is neither local nor pullable; SnapshotCorrupt if its files are not what
        the manifest lists.
        """
        tier = self.tier()
        try:
            return await self._checked(Acquired(self.path, self._pin(holder), tier, None))
        except SnapshotNotFound:
            if self.remote is None:
                raise PoolError(
                    f"snapshot {self.snapshot_id[:12]} is not in the store {self.store.root} and the "
                    "deployment names no object storage to pull it from"
                ) from None
        try:
            report = await pull(
                self.store,
                self.remote,
                self.remote_config or RemoteConfig.from_env(),
                expected_id=self.snapshot_id,
            )
            acquired = Acquired(report.path, self._pin(holder), Tier.OBJECT_STORAGE, report)
        except SnapshotError as exc:
            raise PoolError(f"cannot pull {self.remote}: {exc}") from exc
        return await self._checked(acquired)

    async def _checked(self, acquired: Acquired) -> Acquired:
        """`acquired` once its files check out; else its pin is let go and SnapshotCorrupt raised."""
        try:
            await asyncio.to_thread(self.store.check_for_start, self.snapshot_id)
        except BaseException as exc:
            acquired.pin.release()
            if isinstance(exc, CorruptSnapshot):
                raise SnapshotCorrupt(str(exc)) from exc
            if isinstance(exc, SnapshotError):
                raise PoolError(f"cannot check snapshot {self.snapshot_id[:12]}: {exc}") from exc
            raise
        return acquired

    def _pin(self, holder: str) -> Pin:
        pin = self.store.pin(self.snapshot_id, holder)
        self.store.touch(self.snapshot_id)
        return pin
