"""A deployment's snapshot as the pool sees it: made local before an instance starts, pinned while used.

A start never waits for a download it could have avoided: when the snapshot is in the local store
it is pinned and used as it is; only when it is not (never pulled, or evicted under the disk budget)
is it pulled from the object storage the deployment names, and every concurrent start shares that
one pull (the store's per-snapshot lock). The pin is held for the instance's life, so the store's
eviction and `stoker snapshot gc` never take the files from under a running engine.

`tier()` says where a start would load from right now (object storage, local disk, page cache):
the scaler's lead time depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from snapshots import SnapshotError, SnapshotNotFound, SnapshotStore, pagecache
from snapshots.pins import Pin
from snapshots.remote import PullReport, pull
from snapshots.s3 import RemoteConfig
from warm_pool.errors import PoolError
from warm_pool.policy import Tier

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
        """Pin the snapshot for `holder`, pulling it first if it is not local. PoolError if neither."""
        tier = self.tier()
        try:
            return Acquired(self.path, self._pin(holder), tier, None)
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
            return Acquired(report.path, self._pin(holder), Tier.OBJECT_STORAGE, report)
        except SnapshotError as exc:
            raise PoolError(f"cannot pull {self.remote}: {exc}") from exc

    def _pin(self, holder: str) -> Pin:
        pin = self.store.pin(self.snapshot_id, holder)
        self.store.touch(self.snapshot_id)
        return pin
