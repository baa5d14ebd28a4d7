"""The local, content-addressed snapshot store.

Layout under the store root (`$STOKER_HOME/snapshots`):

    <id>/                   one snapshot: model files + manifest.json, files read-only
    names/<name>            an alias: the file holds the id it points at (a name may move)
    sources/<sha256>        import index: sha256 of a source file (a GGUF) -> the id made from it
    remotes/<id>            the s3:// URIs known to hold the snapshot, one a line (pushed to, pulled from)
    .pull-<id>/             a pull from object storage in progress or interrupted; kept for resume,
                            never listed (with .pull-<id>.journal and .pull-<id>.lock beside it)
    .tmp-<host>-<pid>-<rnd>/  a snapshot being written; hidden, never listed
    verified/<id>           each file's (size, mtime_ns, ctime_ns, inode) when it last hashed sound
    used/<id>               empty; its mtime is the snapshot's last use (the LRU order, see `usage`)
    pins/<id>               flock'd shared by each holder of a pin; pins/<id>.holder-* name them
    .trash-<rnd>/           a snapshot being deleted (renamed here first, so it vanishes at once)
    .lock                   flock'd while evicting or collecting garbage

A snapshot appears only by renaming a fully written, fsynced temp dir onto `<id>`, so nothing that
lists the store can see half of one, and a writer killed halfway leaves only a hidden temp dir.
Identical bytes are stored once: a commit whose `<id>` exists already discards its temp dir.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapshots import pins, usage
from snapshots.adapter import AdapterInfo
from snapshots.durable import READ_BITS, fsync_dir, fsync_file, write_atomic
from snapshots.errors import (
    AmbiguousRef,
    CorruptSnapshot,
    InvalidName,
    SnapshotError,
    SnapshotNotFound,
    StoreWriteError,
)
from snapshots.manifest import MANIFEST_NAME, Manifest
from snapshots.owner import is_stale, private_name
from snapshots.verify import FileStat, Problem, check_dir, file_stat

TMP_PREFIX = ".tmp-"
PULL_PREFIX = ".pull-"
MIN_PREFIX_CHARS = 8
_ID = re.compile(r"[0-9a-f]{64}")
_ID_PREFIX = re.compile(rf"[0-9a-f]{{{MIN_PREFIX_CHARS},63}}")
_SHORT_HEX = re.compile(rf"[0-9a-fA-F]{{1,{MIN_PREFIX_CHARS - 1}}}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: str) -> str:
    """Return `name` if it can be an alias file name; raise InvalidName otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidName(
            f"invalid snapshot name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with "
            "a letter or digit"
        )
    return name


@dataclass(frozen=True)
class SnapshotRecord:
    """What `ls` shows about one stored snapshot."""

    id: str
    names: tuple[str, ...]
    path: Path
    bytes: int  # sum of the listed files' sizes (the manifest itself not counted)
    dtype: str  # "?" when the manifest cannot be read: run verify
    created: str  # ISO 8601, UTC
    source: str
    kind: str = "model"  # or "adapter": a PEFT LoRA adapter, described by `adapter`
    adapter: AdapterInfo | None = None

    @property
    def name(self) -> str | None:
        return self.names[0] if self.names else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "names": list(self.names),
            "path": str(self.path),
            "bytes": self.bytes,
            "dtype": self.dtype,
            "created": self.created,
            "source": self.source,
            "kind": self.kind,
            "adapter": None if self.adapter is None else self.adapter.to_dict(),
        }


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class SnapshotStore:
    """Snapshots under one root directory. Cheap to construct; holds no state but the path."""

    def __init__(
        self, root: Path, budget_bytes: int | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        """`budget_bytes`: most bytes of snapshots to keep (None: only the free disk limits them).

        `clock` gives the wall time (epoch seconds) that `touch` records as a snapshot's last use.
        """
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 1):
            raise ValueError(f"budget_bytes must be a positive number of bytes or None, not {budget_bytes!r}")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.clock = clock
        self.used_dir = self.root / "used"
        self.pins_dir = self.root / "pins"
        self.names_dir = self.root / "names"
        self.sources_dir = self.root / "sources"
        self.remotes_dir = self.root / "remotes"
        self.verified_dir = self.root / "verified"

    # --- reading ---------------------------------------------------------------------------------

    def path_of(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id

    def ids(self) -> builtins.list[str]:
        """The ids of every complete snapshot (temp dirs and index dirs are not ids)."""
        try:
            entries = builtins.list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if _ID.fullmatch(e.name) and e.is_dir(follow_symlinks=False))

    def manifest(self, snapshot_id: str) -> Manifest:
        path = self.path_of(snapshot_id) / MANIFEST_NAME
        try:
            return Manifest.from_json(path.read_bytes())
        except FileNotFoundError as exc:
            raise CorruptSnapshot(f"snapshot {snapshot_id[:12]} has no {MANIFEST_NAME}") from exc
        except OSError as exc:
            raise CorruptSnapshot(f"cannot read {path}: {exc.strerror or exc}") from exc

    def names(self) -> dict[str, str]:
        """Every alias: name -> id (the id may be dangling if its snapshot was removed)."""
        out: dict[str, str] = {}
        try:
            entries = builtins.list(os.scandir(self.names_dir))
        except FileNotFoundError:
            return out
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                continue  # "." names are write_atomic's temp files
            try:
                target = Path(entry.path).read_text().strip()
            except OSError:
                continue
            if _ID.fullmatch(target):
                out[entry.name] = target
        return out

    def record(self, snapshot_id: str, names: dict[str, str] | None = None) -> SnapshotRecord:
        path = self.path_of(snapshot_id)
        if not path.is_dir():
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}")
        aliases = self.names() if names is None else names
        own = tuple(sorted(n for n, i in aliases.items() if i == snapshot_id))
        try:
            m = self.manifest(snapshot_id)
        except SnapshotError:
            return SnapshotRecord(snapshot_id, own, path, 0, "?", "", "")
        return SnapshotRecord(
            snapshot_id, own, path, m.total_bytes, m.dtype, m.created, m.source, m.kind, m.adapter
        )

    def list(self) -> builtins.list[SnapshotRecord]:
        """Every complete snapshot, oldest first."""
        aliases = self.names()
        records = [self.record(i, aliases) for i in self.ids()]
        return sorted(records, key=lambda r: (r.created, r.id))

    def resolve(self, ref: str) -> SnapshotRecord:
        """Find a snapshot by full id, name, or unique id prefix of at least 8 hex characters.

        A name wins over an id prefix that happens to spell the same characters.
        """
        if _ID.fullmatch(ref.lower()):
            return self.record(ref.lower())
        if _NAME.fullmatch(ref) and (self.names_dir / ref).is_file():
            target = self.names().get(ref)
            if target is None or not self.path_of(target).is_dir():
                shown = target[:12] if target else "nothing readable"
                raise SnapshotNotFound(f"name {ref!r} points at {shown}, which is not in {self.root}")
            return self.record(target)
        if _ID_PREFIX.fullmatch(ref.lower()):
            matches = [i for i in self.ids() if i.startswith(ref.lower())]
            if len(matches) == 1:
                return self.record(matches[0])
            if len(matches) > 1:
                shown = ", ".join(m[:12] for m in matches[:5])
                raise AmbiguousRef(f"id prefix {ref!r} matches {len(matches)} snapshots ({shown}); give more")
        hint = ""
        if _SHORT_HEX.fullmatch(ref):
            hint = f" (id prefixes need at least {MIN_PREFIX_CHARS} hex characters)"
        raise SnapshotNotFound(f"no snapshot matches {ref!r} (by name, id or id prefix) in {self.root}{hint}")

    def verify(self, snapshot_id: str) -> builtins.list[Problem]:
        """Re-hash every file of a snapshot; return the problems found (empty: sound)."""
        path = self.path_of(snapshot_id)
        if not path.is_dir():
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}")
        problems, sound = check_dir(path, snapshot_id, {})
        self._remember_verified(snapshot_id, sound)
        return problems

    def check_for_start(self, snapshot_id: str) -> None:
        """Before an engine loads the snapshot: raise CorruptSnapshot unless every file checks out.

        Every file's size is compared with the manifest, and its sha256 too unless the file is
        unchanged since it last hashed sound (`verified/<id>`, see `verify.check_dir`): a start
        after an import, a pull or a verify costs a stat per file, not a read of the weights.
        """
        path = self.path_of(snapshot_id)
        if not path.is_dir():
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}")
        problems, sound = check_dir(path, snapshot_id, self._verified(snapshot_id))
        self._remember_verified(snapshot_id, sound)
        if problems:
            shown = "; ".join(str(p) for p in problems[:3])
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CorruptSnapshot(
                f"snapshot {snapshot_id[:12]} is corrupt: {shown}{more}; pull or import it again "
                f"(`stoker snapshot verify {snapshot_id[:12]}` lists every bad file)"
            )

    def _verified(self, snapshot_id: str) -> dict[str, FileStat]:
        try:
            doc = json.loads((self.verified_dir / snapshot_id).read_bytes())
            return {str(k): (int(a), int(b), int(c), int(d)) for k, (a, b, c, d) in doc["files"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}  # none, or unreadable: everything is hashed, which is only slower

    def _remember_verified(self, snapshot_id: str, sound: dict[str, FileStat]) -> None:
        if not _ID.fullmatch(snapshot_id):
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        data = json.dumps({"files": sound}, sort_keys=True).encode()
        try:
            self.verified_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.verified_dir / snapshot_id, data)
        except (OSError, StoreWriteError):
            pass  # a read-only store still starts; the next check hashes again

    def lookup_source(self, digest: str) -> str | None:
        """The id previously made from a source file with this sha256, if that snapshot still exists."""
        try:
            target = (self.sources_dir / digest).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            return None
        if _ID.fullmatch(target) and self.path_of(target).is_dir():
            return target
        return None

    # --- use, pins and room (the work is in `usage`, `pins` and `eviction`) -----------------------

    def touch(self, snapshot_id: str) -> None:
        """Record a use of the snapshot now (imports, pulls and engine starts call this)."""
        usage.touch(self, snapshot_id)

    def last_used(self, snapshot_id: str) -> float:
        """Epoch seconds of the last `touch`, or of the snapshot's creation if never touched."""
        return usage.last_used(self, snapshot_id)

    def pin(self, snapshot_id: str, holder: str) -> pins.Pin:
        """Hold the snapshot against eviction, gc and removal by any process until `.release()`.

        Also a context manager. The pin goes with its process, so a crashed holder leaves none.
        Raises SnapshotNotFound if the snapshot is not (or no longer) stored.
        """
        if not _ID.fullmatch(snapshot_id):
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        return pins.acquire(self.pins_dir, snapshot_id, holder, self.path_of(snapshot_id))

    def is_pinned(self, snapshot_id: str) -> bool:
        return pins.is_pinned(self.pins_dir, snapshot_id)

    def pinned_by(self, snapshot_id: str) -> builtins.list[str]:
        """The holder names of the live pins on the snapshot (best effort: for display only)."""
        return pins.holders(self.pins_dir, snapshot_id)

    def make_room(self, nbytes: int) -> builtins.list[str]:
        """Before writing `nbytes` of new snapshot data: evict LRU unpinned snapshots until they fit.

        Fitting means within the budget and with `nbytes` plus a small reserve free on disk. Returns
        the evicted ids; raises StoreFull, evicting nothing, when even evicting every unpinned
        snapshot would not do.
        """
        return usage.make_room(self, nbytes)

    def remove(self, snapshot_id: str) -> bool:
        """Delete a snapshot and its names; False if it was not there; SnapshotPinned if in use."""
        return usage.remove(self, snapshot_id)

    def gc(self, budget: int | None = None, *, dry_run: bool = False) -> usage.GcReport:
        """Remove leftovers, then evict LRU unpinned snapshots down to `budget` (default: the store's).

        Leftovers: temp and pull dirs whose writer is gone, trash, and index and pin files that
        point at no snapshot.
        """
        return usage.gc(self, budget, dry_run)

    # --- writing ---------------------------------------------------------------------------------

    def set_name(self, name: str, snapshot_id: str) -> None:
        """Point alias `name` at `snapshot_id`, replacing whatever it pointed at before."""
        check_name(name)
        self._write_index(self.names_dir, name, snapshot_id)

    def remember_source(self, digest: str, snapshot_id: str) -> None:
        self._write_index(self.sources_dir, digest, snapshot_id)

    def remotes(self, snapshot_id: str) -> builtins.list[str]:
        """The s3:// URIs this snapshot was pushed to or pulled from, oldest first."""
        try:
            text = (self.remotes_dir / snapshot_id).read_text()
        except OSError:  # none recorded (or unreadable: an index, not the data)
            return []
        return [line for line in text.splitlines() if line.startswith("s3://")]

    def remember_remote(self, snapshot_id: str, uri: str) -> None:
        """Record that `uri` holds this snapshot (read-modify-write: two writers at once may drop one)."""
        if not _ID.fullmatch(snapshot_id):
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        known = self.remotes(snapshot_id)
        if uri in known:
            return
        try:
            self.remotes_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreWriteError(f"cannot create {self.remotes_dir}: {exc.strerror or exc}") from exc
        write_atomic(self.remotes_dir / snapshot_id, "".join(f"{u}\n" for u in [*known, uri]).encode())

    def pull_dir(self, snapshot_id: str) -> Path:
        """Where a pull of `snapshot_id` writes; hidden, and kept across interruptions so it can resume.

        `commit` accepts it like a staging dir once every file in it checks out.
        """
        if not _ID.fullmatch(snapshot_id):
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        return self.root / f"{PULL_PREFIX}{snapshot_id}"

    def _write_index(self, directory: Path, key: str, snapshot_id: str) -> None:
        if not _ID.fullmatch(snapshot_id):
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreWriteError(f"cannot create {directory}: {exc.strerror or exc}") from exc
        write_atomic(directory / key, (snapshot_id + "\n").encode())

    @contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh hidden temp dir inside the root to write a snapshot into, then `commit`.

        Whatever happens inside the block, the temp dir does not outlive it: committed (renamed
        away), or removed. An OSError (disk full, permissions) becomes a StoreWriteError.
        """
        tmp = self.root / private_name(TMP_PREFIX)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            raise StoreWriteError(f"cannot create a snapshot in {self.root}: {exc.strerror or exc}") from exc
        try:
            yield tmp
        except OSError as exc:
            _remove_tree(tmp)
            where = f" ({exc.filename})" if exc.filename else ""
            raise StoreWriteError(
                f"cannot write the snapshot into {self.root}: {exc.strerror or exc}{where}"
            ) from exc
        except BaseException:
            _remove_tree(tmp)
            raise
        _remove_tree(tmp)  # not committed: the caller gave up without raising

    def commit(self, tmpdir: Path) -> str:
        """Move a fully written temp dir (files + manifest.json) into place as `<id>`; return the id.

        Every file and directory is fsynced before the rename, and the root after it. If `<id>`
        exists already (same bytes imported before, or by a concurrent import that won the
        rename) the temp dir is discarded: stored once.
        """
        tmpdir = Path(tmpdir)
        if tmpdir.parent != self.root or not tmpdir.name.startswith((TMP_PREFIX, PULL_PREFIX)):
            raise ValueError(f"not a staging dir of this store: {tmpdir}")
        manifest = Manifest.from_json((tmpdir / MANIFEST_NAME).read_bytes())
        for entry in manifest.files:
            path = tmpdir / entry.path
            if not path.is_file() or path.stat().st_size != entry.size:
                raise CorruptSnapshot(f"staged file {entry.path} is missing or not {entry.size} bytes")
        snapshot_id = manifest.snapshot_id
        target = self.path_of(snapshot_id)
        if target.is_dir():
            _remove_tree(tmpdir)
            return snapshot_id
        for dirpath, _dirnames, filenames in os.walk(tmpdir, topdown=False):
            for filename in filenames:
                path = Path(dirpath) / filename
                # A snapshot is exact bytes: read-only, and never more readable than it was written.
                path.chmod(stat.S_IMODE(path.lstat().st_mode) & READ_BITS)
                fsync_file(path)  # cheap when the writer fsynced already; not every writer does
            fsync_dir(Path(dirpath))
        try:
            os.rename(tmpdir, target)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and target.is_dir():
                _remove_tree(tmpdir)  # a concurrent import of the same bytes got there first
                return snapshot_id
            raise
        fsync_dir(self.root)
        # Every writer hashed these bytes on their way in (an import as it copied, a pull before
        # this commit): the first start needs to stat them, not hash them again.
        hashed = {e.path: file_stat(os.lstat(target / e.path)) for e in manifest.files}
        self._remember_verified(snapshot_id, hashed)
        return snapshot_id

    def remove_stale_tmp(self, *, dry_run: bool = False) -> builtins.list[Path]:
        """Remove temp dirs left by imports that were killed; return what was (or would be) removed.

        Staleness is judged by the writer's pid, not by age (`snapshots.owner`): a single multi-GB
        file copy or a 40 s GGUF conversion leaves the temp dir's mtime untouched for minutes, so
        "older than a minute" would delete live imports.
        """
        removed: builtins.list[Path] = []
        try:
            entries = builtins.list(os.scandir(self.root))
        except FileNotFoundError:
            return removed
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False) or not is_stale(entry.name, TMP_PREFIX):
                continue
            if not dry_run:
                _remove_tree(Path(entry.path))
            removed.append(Path(entry.path))
        return removed
