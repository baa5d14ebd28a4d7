"""Pins: a snapshot in use is held against eviction, gc and removal, from any process.

A pin is an `fcntl.flock` on `pins/<id>`: every pinner holds it shared, and whoever wants to delete
the snapshot must first take it exclusive without waiting. The kernel drops a lock with the last
descriptor of its holder, so a pin lives exactly as long as the process (or the `Pin` object) that
took it: a crashed instance leaves no stale pin behind, and there is no lease to renew.

Locks taken through separate `open()`s conflict even inside one process, so a pin held by this
process blocks this process's own evictor too.

Who holds a pin is recorded for `ls` in a side file `pins/<id>.holder-<pid>-<random>` holding the
name, locked exclusive by its writer so a reader can tell a live holder from a crashed one's
leftover (best effort: a holder seen in the instant between its creation and its lock is missed).

A lock file is removed only by someone holding it exclusive (a removal, or gc of a snapshot that is
gone). A pinner may have opened the old file just before; it notices, after its lock is granted,
that the path now names a different file (or none) and starts over on the current one.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from snapshots.errors import SnapshotNotFound, StoreWriteError

HOLDER_MARK = ".holder-"


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _still_named(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a remover may have unlinked it)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def lock_file(path: Path, operation: int) -> int | None:
    """Open and flock the file `path` names now (created if need be); None if LOCK_NB was refused."""
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _still_named(fd, path):
            return fd
        os.close(fd)  # removed while we waited: the current file is the one that counts


def locked_by_someone(path: Path) -> bool:
    """Whether any open file description holds a flock on `path` (probed without waiting)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases the probe's own lock, if it got one
    return False


class Pin:
    """A held pin on one snapshot; `release()` or leave the `with` block to let it go."""

    def __init__(self, snapshot_id: str, holder: str, lock_fd: int, side: tuple[Path, int] | None) -> None:
        self.snapshot_id = snapshot_id
        self.holder = holder
        self._lock_fd: int | None = lock_fd
        self._side = side  # the holder file and its descriptor, if it could be written

    @property
    def held(self) -> bool:
        return self._lock_fd is not None

    def release(self) -> None:
        """Let the snapshot go; calling it again does nothing."""
        if self._side is not None:
            path, fd = self._side
            self._side = None
            path.unlink(missing_ok=True)
            os.close(fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor drops the shared lock
            self._lock_fd = None

    def __enter__(self) -> Pin:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        # A Pin nobody references any more pins nothing: let it go rather than leak the descriptor.
        if getattr(self, "_lock_fd", None) is not None:
            self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"Pin({self.snapshot_id[:12]}, holder={self.holder!r}, {state})"


def _write_holder(pins_dir: Path, snapshot_id: str, holder: str) -> tuple[Path, int] | None:
    """Create and lock the side file that names the holder; best effort, so never raises."""
    path = pins_dir / f"{snapshot_id}{HOLDER_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, holder.encode(errors="replace")[:512])
    except OSError:
        path.unlink(missing_ok=True)
        os.close(fd)
        return None
    return path, fd


def acquire(pins_dir: Path, snapshot_id: str, holder: str, snapshot_dir: Path) -> Pin:
    """Pin `snapshot_id`, waiting out an eviction in progress; SnapshotNotFound if it is not stored.

    The wait is short: an evictor holds the lock exclusive only to rename the snapshot away. The
    snapshot's presence is checked after the lock is granted, since before it, it could still go.
    """
    try:
        pins_dir.mkdir(parents=True, exist_ok=True)
        fd = lock_file(pins_dir / snapshot_id, fcntl.LOCK_SH)
    except OSError as exc:
        raise StoreWriteError(
            f"cannot pin snapshot {snapshot_id[:12]} in {pins_dir}: {exc.strerror or exc}"
        ) from exc
    assert fd is not None  # a blocking lock is never refused
    if not snapshot_dir.is_dir():
        os.close(fd)
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in {snapshot_dir.parent} to pin")
    return Pin(snapshot_id, holder, fd, _write_holder(pins_dir, snapshot_id, holder))


def is_pinned(pins_dir: Path, snapshot_id: str) -> bool:
    return locked_by_someone(pins_dir / snapshot_id)


def holders(pins_dir: Path, snapshot_id: str) -> list[str]:
    """The names of the live holders of pins on `snapshot_id`, sorted (best effort)."""
    names: list[str] = []
    for path in _holder_files(pins_dir, snapshot_id):
        if not locked_by_someone(path):
            continue  # its writer is gone: a leftover for gc
        try:
            names.append(path.read_text(errors="replace").strip() or "?")
        except OSError:
            continue
    return sorted(names)


@contextmanager
def exclusive(pins_dir: Path, snapshot_id: str) -> Iterator[bool]:
    """Hold `snapshot_id` against new pins while the block runs; yields False if it is pinned now."""
    path = pins_dir / snapshot_id
    try:
        pins_dir.mkdir(parents=True, exist_ok=True)
        fd = lock_file(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise StoreWriteError(f"cannot lock {path}: {exc.strerror or exc}") from exc
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def retire(pins_dir: Path, snapshot_id: str) -> list[Path]:
    """Remove the pin files of a snapshot that is gone; call it inside `exclusive`, never outside.

    Holder files are all leftovers while the lock is exclusive (live pinners hold it shared), and the
    lock file would only dangle; a pinner that opened it just before notices and starts over.
    """
    gone = [*_holder_files(pins_dir, snapshot_id), pins_dir / snapshot_id]
    for path in gone:
        path.unlink(missing_ok=True)
    return gone


def _holder_files(pins_dir: Path, snapshot_id: str) -> list[Path]:
    return sorted(pins_dir.glob(f"{snapshot_id}{HOLDER_MARK}*"))


def pinned_ids(pins_dir: Path) -> set[str]:
    """The ids that have any file under `pins/` (pinned now, or once): what `sweep` should look at."""
    try:
        names = os.listdir(pins_dir)
    except FileNotFoundError:
        return set()
    return {n.split(HOLDER_MARK, 1)[0] for n in names if not n.startswith(".")}


def sweep(pins_dir: Path, snapshot_id: str, *, gone: bool, dry_run: bool) -> list[Path]:
    """The leftover pin files of `snapshot_id`, removed unless `dry_run`; none while it is pinned.

    Leftovers are holder files of crashed holders, plus the lock file itself when the snapshot is
    `gone` from the store.
    """
    with exclusive(pins_dir, snapshot_id) as free:
        if not free:
            return []
        leftovers = _holder_files(pins_dir, snapshot_id) + ([pins_dir / snapshot_id] if gone else [])
        if not dry_run:
            for path in leftovers:
                path.unlink(missing_ok=True)
        return leftovers
