"""The store's upkeep: last uses, room for new snapshots, removal, and garbage collection.

`SnapshotStore` delegates here; the decisions themselves are in `eviction` (pure) and the locks in
`pins`. Nothing lives in memory: the last use of a snapshot is the mtime of `used/<id>` (or, never
touched, of its manifest), pins are flocks, sizes are in the manifests. So a fresh store object, a
restarted platform, or another process on the same root sees the same LRU order and the same pins.

A snapshot is deleted by renaming it to a hidden `.trash-<random>` dir while holding its pin lock
exclusive, then deleting the trash: a reader sees the whole snapshot or none of it, and a deletion
cut short leaves only trash, which nothing reads and the next gc clears.

Evictions, removals and gc run under one store-wide flock (`.lock`), so two processes making room
at once do not both count the same victim's bytes as freed. What the lock does not cover, by design: two
writers that both find room before either has written may together overshoot the budget by up to
one snapshot, which the next `make_room` or gc evicts; the disk itself keeps a reserve for that.
"""

from __future__ import annotations

import builtins
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapshots import pins, pulldir
from snapshots.compile_cache import CompileCaches
from snapshots.durable import fsync_dir
from snapshots.errors import SnapshotError, SnapshotNotFound, SnapshotPinned, StoreFull, StoreWriteError
from snapshots.eviction import Plan, Stored, plan_budget, plan_room
from snapshots.kept_kv import KeptKv
from snapshots.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from snapshots.store import SnapshotStore

TRASH_PREFIX = ".trash-"
_PULL = re.compile(r"\.pull-([0-9a-f]{64})(?:\..*)?")  # a pull dir and its journal and lock beside it
STORE_LOCK = ".lock"
# The disk keeps 1 % of its size free after a write, at most 1 GiB: room for manifests, index files,
# the registry and logs, and for a concurrent writer's overshoot (ext4 keeps its own 5 % for root).
RESERVE_FRACTION = 0.01
RESERVE_MAX = 1 << 30
# A pin that lands between the look and the locks makes make_room look again; pins arriving that
# often mean the store is busy beyond what another look would fix.
MAX_LOOKS = 8


def _disk_bytes(path: Path) -> int:
    """Bytes `path` takes on disk (allocated blocks: a pull preallocates sparse files)."""
    try:
        if not path.is_dir():
            return path.lstat().st_blocks * 512
    except OSError:
        return 0
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for filename in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, filename)).st_blocks * 512
            except OSError:
                continue
    return total


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_free(root: Path) -> tuple[int, int]:
    """(bytes free to an unprivileged writer, reserve to keep) on the filesystem holding `root`."""
    st = os.statvfs(_existing(root))
    size = st.f_blocks * st.f_frsize
    return st.f_bavail * st.f_frsize, min(RESERVE_MAX, int(size * RESERVE_FRACTION))


# --- last use --------------------------------------------------------------------------------------


def touch(store: SnapshotStore, snapshot_id: str) -> None:
    if not store.path_of(snapshot_id).is_dir():
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in {store.root}")
    path = store.used_dir / snapshot_id
    now_ns = int(store.clock() * 1e9)
    try:
        store.used_dir.mkdir(parents=True, exist_ok=True)
        path.touch()
        # An explicit time, not the kernel's: file timestamps tick in jiffies, and two uses a
        # millisecond apart must still sort in the order they happened.
        os.utime(path, ns=(now_ns, now_ns))
    except OSError as exc:
        raise StoreWriteError(
            f"cannot record a use of {snapshot_id[:12]} in {path}: {exc.strerror or exc}"
        ) from exc


def last_used(store: SnapshotStore, snapshot_id: str) -> float:
    directory = store.path_of(snapshot_id)
    for path in (store.used_dir / snapshot_id, directory / MANIFEST_NAME, directory):
        try:
            return path.stat().st_mtime_ns / 1e9
        except OSError:
            continue
    raise SnapshotNotFound(f"no snapshot {snapshot_id} in {store.root}")


def observe(store: SnapshotStore) -> list[Stored]:
    """Every stored snapshot as the eviction policy sees it."""
    out = []
    for snapshot_id in store.ids():
        try:
            size = store.manifest(snapshot_id).total_bytes
            used = last_used(store, snapshot_id)
        except SnapshotError:  # unreadable manifest, or removed while we looked
            size, used = _disk_bytes(store.path_of(snapshot_id)), 0.0
        size += CompileCaches(store.root).bytes_of(snapshot_id)  # its compile caches go with it
        size += KeptKv(store.root).bytes_of(snapshot_id)  # and its kept KV
        out.append(Stored(snapshot_id, size, used, store.is_pinned(snapshot_id)))
    return out


# --- deleting ------------------------------------------------------------------------------------


@contextmanager
def _store_lock(store: SnapshotStore) -> Iterator[None]:
    try:
        store.root.mkdir(parents=True, exist_ok=True)
        fd = pins.lock_file(store.root / STORE_LOCK, fcntl.LOCK_EX)
    except OSError as exc:
        raise StoreWriteError(f"cannot lock {store.root}: {exc.strerror or exc}") from exc
    assert fd is not None
    try:
        yield
    finally:
        os.close(fd)


def _unlink_pointing_at(directory: Path, snapshot_id: str) -> None:
    """Remove the index files in `directory` (names, sources) whose content is `snapshot_id`."""
    try:
        entries = builtins.list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and Path(entry.path).read_text().strip() == snapshot_id:
                Path(entry.path).unlink(missing_ok=True)
        except OSError:
            continue


def _to_trash(store: SnapshotStore, snapshot_id: str) -> Path | None:
    """Rename a snapshot away and drop its index entries; call while holding its pin lock exclusive.

    Returns the trash dir to delete once the lock is let go, or None if the snapshot was gone.
    """
    trash = store.root / f"{TRASH_PREFIX}{secrets.token_hex(8)}"
    try:
        os.rename(store.path_of(snapshot_id), trash)
    except FileNotFoundError:
        trash = None  # removed by someone else meanwhile; its index entries may still dangle
    except OSError as exc:
        raise StoreWriteError(f"cannot remove snapshot {snapshot_id[:12]}: {exc.strerror or exc}") from exc
    else:
        fsync_dir(store.root)
    _unlink_pointing_at(store.names_dir, snapshot_id)
    _unlink_pointing_at(store.sources_dir, snapshot_id)
    (store.used_dir / snapshot_id).unlink(missing_ok=True)
    (store.verified_dir / snapshot_id).unlink(missing_ok=True)
    pins.retire(store.pins_dir, snapshot_id)
    # Its compile caches go with it; deleted now (small next to the weights), or by the next gc.
    if (caches := CompileCaches(store.root).remove(snapshot_id)) is not None:
        _rmtree(caches)
    if (kept := KeptKv(store.root).remove(snapshot_id)) is not None:  # its kept KV too
        _rmtree(kept)
    return trash


def remove(store: SnapshotStore, snapshot_id: str) -> bool:
    if not store.path_of(snapshot_id).is_dir():
        return False
    # Under the store lock, so that an eviction or gc holding this snapshot's lock for a moment is
    # waited out rather than mistaken for a pin.
    with _store_lock(store), pins.exclusive(store.pins_dir, snapshot_id) as free:
        if not free:
            who = ", ".join(pins.holders(store.pins_dir, snapshot_id)) or "another process"
            raise SnapshotPinned(f"snapshot {snapshot_id[:12]} is in use (pinned by {who}); not removed")
        trash = _to_trash(store, snapshot_id)
    if trash is None:
        return False
    _rmtree(trash)
    return True


def _evict(store: SnapshotStore, plan: Plan) -> builtins.list[str] | None:
    """Delete every snapshot of `plan`, or none if one of them is pinned by now (then None)."""
    trash: builtins.list[Path] = []
    with ExitStack() as stack:
        if not all(stack.enter_context(pins.exclusive(store.pins_dir, i)) for i in plan.evict):
            return None  # a pin arrived between the look and the locks: look again
        for snapshot_id in plan.evict:
            if (path := _to_trash(store, snapshot_id)) is not None:
                trash.append(path)
    for path in trash:  # pin locks let go first: a pinner waiting on one learns at once it is gone
        _rmtree(path)
    return builtins.list(plan.evict)


def make_room(store: SnapshotStore, nbytes: int) -> builtins.list[str]:
    if nbytes < 0:
        raise ValueError(f"make_room needs a byte count >= 0, not {nbytes}")

    def look() -> Plan:
        free, reserve = disk_free(store.root)
        return plan_room(observe(store), nbytes, budget=store.budget_bytes, free=free, reserve=reserve)

    plan = look()  # most writes fit: no lock, no lock file
    if not plan.evict and plan.problem is None:
        return []
    with _store_lock(store):
        for _ in range(MAX_LOOKS):
            plan = look()  # again under the lock: another process may have made room, or taken it
            if plan.problem is not None:
                raise StoreFull(f"{plan.problem} (store {store.root})")
            if not plan.evict:
                return []
            evicted = _evict(store, plan)
            if evicted is not None:
                return evicted
    raise StoreFull(f"no room for {nbytes} bytes in {store.root}: snapshots kept being pinned while evicting")


# --- gc --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Removed:
    """One thing gc removed (or, in a dry run, would remove)."""

    kind: str  # snapshot | temp | pull | trash | compile | kv | name | source | used | pin
    path: Path
    bytes: int
    id: str | None = None  # the evicted snapshot's id

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "bytes": self.bytes, "id": self.id}


@dataclass(frozen=True)
class GcReport:
    dry_run: bool
    removed: tuple[Removed, ...]
    budget: int | None
    stored_bytes: int  # in snapshots, after gc (as it would be, for a dry run)
    problem: str | None = None  # why the store is still over budget, if it is

    @property
    def bytes_freed(self) -> int:
        return sum(r.bytes for r in self.removed)

    @property
    def evicted(self) -> builtins.list[str]:
        return [r.id for r in self.removed if r.kind == "snapshot" and r.id]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "removed": [r.to_dict() for r in self.removed],
            "evicted": self.evicted,
            "bytes_freed": self.bytes_freed,
            "budget": self.budget,
            "stored_bytes": self.stored_bytes,
            "problem": self.problem,
        }


def _hidden_leftovers(store: SnapshotStore, dry_run: bool) -> builtins.list[Removed]:
    """Temp dirs of dead writers, trash, and pulls nobody is running (their lock is free)."""
    out = [Removed("temp", p, _disk_bytes(p)) for p in store.remove_stale_tmp(dry_run=True)]
    try:
        names = sorted(os.listdir(store.root))
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith(TRASH_PREFIX):
            out.append(Removed("trash", store.root / name, _disk_bytes(store.root / name)))
    pulls = {m.group(1) for n in names if (m := _PULL.fullmatch(n))}
    for snapshot_id in sorted(pulls):
        out.extend(_stale_pull(store, snapshot_id, dry_run))
    for path in CompileCaches(store.root).leftovers(set(store.ids())):
        out.append(Removed("compile", path, _disk_bytes(path)))
    for path in KeptKv(store.root).leftovers(set(store.ids())):
        out.append(Removed("kv", path, _disk_bytes(path)))
    if not dry_run:
        for item in out:
            if item.kind != "pull":  # _stale_pull removes its own, under the pull's lock
                _rmtree(item.path)
    return out


def _stale_pull(store: SnapshotStore, snapshot_id: str, dry_run: bool) -> builtins.list[Removed]:
    """The pull dir and journal of `snapshot_id` if no pull holds its lock (then removed, unless dry)."""
    pull_dir = store.pull_dir(snapshot_id)
    lock = pulldir.lock_path(pull_dir)
    parts = [p for p in (pull_dir, pulldir.journal_path(pull_dir)) if p.exists()]
    if dry_run and not lock.exists():
        return [Removed("pull", p, _disk_bytes(p)) for p in parts]
    fd = pins.lock_file(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        return []  # a pull is running
    try:
        found = [Removed("pull", p, _disk_bytes(p)) for p in parts]
        if not dry_run:
            for p in parts:
                _rmtree(p)
            lock.unlink(missing_ok=True)  # its holder removes it, like a pull does when it is done
        return found
    finally:
        os.close(fd)


def _dangling_index(store: SnapshotStore, present: set[str], dry_run: bool) -> builtins.list[Removed]:
    out: builtins.list[Removed] = []
    for kind, directory in (("name", store.names_dir), ("source", store.sources_dir)):
        try:
            entries = builtins.list(os.scandir(directory))
        except FileNotFoundError:
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                continue
            try:
                target = Path(entry.path).read_text().strip()
            except OSError:
                continue
            if target not in present:
                out.append(Removed(kind, Path(entry.path), _disk_bytes(Path(entry.path))))
    try:
        used = sorted(os.listdir(store.used_dir))
    except FileNotFoundError:
        used = []
    out += [Removed("used", store.used_dir / n, 0) for n in used if n not in present]
    if not dry_run:
        for item in out:
            item.path.unlink(missing_ok=True)
    for snapshot_id in sorted(pins.pinned_ids(store.pins_dir)):
        swept = pins.sweep(store.pins_dir, snapshot_id, gone=snapshot_id not in present, dry_run=dry_run)
        out += [Removed("pin", p, 0) for p in swept]
    return out


def gc(store: SnapshotStore, budget: int | None, dry_run: bool) -> GcReport:
    budget = store.budget_bytes if budget is None else budget
    with _store_lock(store):
        removed = _hidden_leftovers(store, dry_run)
        snapshots = observe(store)
        plan = plan_budget(snapshots, budget) if budget is not None else Plan()
        evicted = plan.evict
        if not dry_run:  # one at a time: one pinned since we looked keeps only itself
            evicted = tuple(i for i in plan.evict if _evict(store, Plan((i,))) is not None)
        sizes = {s.id: s.bytes for s in snapshots}
        removed += [Removed("snapshot", store.path_of(i), sizes[i], i) for i in evicted]
        # An eviction takes the snapshot's names along; only those dangling before are listed here.
        removed += _dangling_index(store, set(store.ids()), dry_run)
    stored = sum(sizes.values()) - sum(sizes[i] for i in evicted)
    return GcReport(dry_run, tuple(removed), budget, stored, plan.problem)
