"""`Pool.warm_snapshot` on a real pool and real files: one warm at a time, shared by concurrent callers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore, pagecache
from warm_pool.backends.local import LocalBackend
from warm_pool.errors import PoolError
from warm_pool.metrics import PoolMetrics
from warm_pool.pool import Pool, PoolSpec
from warm_pool.snapshot import SnapshotSource

SNAPSHOT_ID = "5" * 64


def make_pool(tmp_path: Path, snapshot_dir: Path) -> Pool:
    return Pool(
        PoolSpec(
            deployment="warmed",
            snapshot=SnapshotSource(SnapshotStore(snapshot_dir.parent), snapshot_dir.name),
        ),
        LocalBackend(tmp_path / "logs"),
        PoolMetrics(CollectorRegistry()),
    )


@pytest.fixture
def snapshot_dir(tmp_path: Path) -> Path:
    d = tmp_path / "store" / SNAPSHOT_ID  # where a store keeps a snapshot; warming reads only the files
    d.mkdir(parents=True)
    for name, size in (("model.safetensors", 4 << 20), ("config.json", 500)):
        with (d / name).open("wb") as f:
            f.write(os.urandom(size))
            os.fsync(f.fileno())
    pagecache.drop(d)
    return d


async def test_concurrent_calls_share_one_warm_and_a_later_call_warms_again(tmp_path, snapshot_dir):
    pool = make_pool(tmp_path, snapshot_dir)
    first, second = await asyncio.gather(pool.warm_snapshot(), pool.warm_snapshot())
    assert first is second  # the second call awaited the warm already running
    assert (first.bytes, first.files) == ((4 << 20) + 500, 2)
    assert pagecache.residency(snapshot_dir) == pytest.approx(1.0, abs=0.01)
    third = await pool.warm_snapshot()
    assert third is not first and third.bytes == first.bytes


async def test_a_caller_that_gives_up_does_not_cancel_the_warm_others_await(tmp_path, snapshot_dir):
    pool = make_pool(tmp_path, snapshot_dir)
    quitter = asyncio.create_task(pool.warm_snapshot())
    stayer = asyncio.create_task(pool.warm_snapshot())
    await asyncio.sleep(0)  # both are waiting on the one warm now
    quitter.cancel()
    report = await stayer
    assert quitter.cancelled()
    assert report.bytes == (4 << 20) + 500


async def test_a_missing_snapshot_is_a_pool_error_and_the_next_call_tries_again(tmp_path):
    pool = make_pool(tmp_path, tmp_path / "gone")
    with pytest.raises(PoolError, match="cannot warm its snapshot: no such file or directory"):
        await pool.warm_snapshot()
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "config.json").write_text("{}")
    assert (await pool.warm_snapshot()).bytes == 2
