"""Kept KV beside its snapshot (`snapshots.kept_kv`): counted in the snapshot's size, removed and
evicted with it, and cleared by gc once its snapshot is gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshots import SnapshotStore, import_hf_dir
from snapshots.kept_kv import TMP_PREFIX, KeptKv
from snapshots.owner import private_name
from snapshots.usage import observe
from tests.snapshots.test_budget import make_model
from tests.snapshots.test_compile_cache import _dead_pid


@pytest.fixture
def snapshot(store: SnapshotStore, tmp_path: Path) -> str:
    return import_hf_dir(make_model(tmp_path / "m", seed=1), store, name="m").id


def kept(store: SnapshotStore, snapshot_id: str, nbytes: int = 40_000) -> Path:
    """What an engine leaves after a sleep: one file of blocks in the snapshot's dir of kept KV."""
    directory = KeptKv(store.root).snapshot_dir(snapshot_id)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ("ab" * 32 + ".kv")
    path.write_bytes(b"k" * nbytes)
    return path


def test_kept_kv_counts_in_the_snapshots_size_and_is_removed_with_it(store, snapshot):
    before = {s.id: s.bytes for s in observe(store)}[snapshot]
    path = kept(store, snapshot)
    after = {s.id: s.bytes for s in observe(store)}[snapshot]
    assert after - before == 40_000
    assert store.remove(snapshot)
    assert not path.exists() and not path.parent.exists()
    assert not any(p.name.startswith(".trash") for p in KeptKv(store.root).root.iterdir())


def test_an_evicted_snapshot_takes_its_kept_kv_along(store, snapshot, tmp_path):
    path = kept(store, snapshot)
    store.touch(snapshot)
    other = import_hf_dir(make_model(tmp_path / "n", seed=2), store, name="n").id
    store.touch(other)
    report = store.gc(budget=1 + {s.id: s.bytes for s in observe(store)}[other])  # room for one: the newer
    assert report.evicted == [snapshot]
    assert not path.parent.exists()
    assert other in store.ids()


def test_gc_clears_the_kept_kv_of_snapshots_that_are_gone_and_dead_writers_files(store, snapshot):
    live = kept(store, snapshot)
    orphan = kept(store, "f" * 64)  # a snapshot removed by a version that left its kept KV behind
    writing = live.parent / private_name(TMP_PREFIX)  # this process's, being written: kept
    writing.write_bytes(b"w")
    dead = live.parent / f"{writing.name.rsplit('-', 2)[0]}-{_dead_pid()}-00000000"  # a crashed writer's
    dead.write_bytes(b"d")
    report = store.gc()
    removed = {Path(r["path"]) for r in report.to_dict()["removed"] if r["kind"] == "kv"}
    assert removed == {orphan.parent, dead}
    assert live.exists() and writing.exists() and not orphan.parent.exists() and not dead.exists()


def test_a_snapshot_id_is_required():
    with pytest.raises(ValueError, match="not a snapshot id"):
        KeptKv(Path("/nonexistent")).snapshot_dir("../etc")
