"""What makes a pull resumable and single: the journal of finished parts, and a lock per snapshot.

A pull writes into the store's hidden pull dir for the snapshot (`<root>/.pull-<id>/`, see
`SnapshotStore.pull_dir`), beside which sit two more hidden files:

    .pull-<id>.journal   one JSON line per finished part: path, offset, length, ETag, and the
                         sha256 of the file's bytes from 0 to the part's end
    .pull-<id>.lock      flock'd by whoever is pulling this snapshot

A part is journaled only after its bytes are fsynced and the file's running sha256 (the one checked
against the manifest) has taken them in, in order, so a line promises bytes on disk and the digest
of the prefix they end. That is what makes one hash pass per byte enough: a resumed pull re-hashes
the journaled prefix in order (a disk can lie, a file can be edited), keeps each part whose prefix
digest still matches, and its running digest is then exactly where the kept prefix ends, to go on
from. A part that landed beyond the hashed prefix when the pull stopped is not journaled and is
fetched again. The journal lives outside the pull dir so that the dir, once every file checks out,
can be renamed into the store as it is.

The lock is `fcntl.flock`, which conflicts between separate open()s even within one process, so it
serves two processes and two tasks of one process alike. The lock file is removed by its holder
before unlocking; a waiter that then wins the lock on the removed file notices (its inode is no
longer the path's) and tries again, so two pulls can never hold "the" lock on two different files.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import json
import os
import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from snapshots.durable import CHUNK_BYTES, write_atomic


def journal_path(pull_dir: Path) -> Path:
    return pull_dir.with_name(pull_dir.name + ".journal")


def lock_path(pull_dir: Path) -> Path:
    return pull_dir.with_name(pull_dir.name + ".lock")


@dataclass(frozen=True)
class Part:
    """One finished byte range of one file, as the journal records it."""

    path: str  # the file, relative to the snapshot dir
    offset: int
    length: int
    etag: str  # of the object the bytes came from
    # sha256 of the file's bytes [0, offset + length): of the whole prefix this part ends, not of
    # the part alone (a journal written with per-part digests loads nothing, and is fetched afresh)
    prefix_sha256: str

    def line(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()


class Journal:
    """The append-only record of finished parts; each append is durable before it returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # appends come from worker threads

    def load(self) -> list[Part]:
        """Every well-formed record; a torn last line (a crash mid-append) is ignored."""
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return []
        parts = []
        for line in lines:
            try:
                parts.append(Part(**json.loads(line)))
            except (ValueError, TypeError):
                continue
        return parts

    def append(self, *parts: Part) -> None:
        """Add `parts` in one write and one fsync."""
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, b"".join(p.line() for p in parts))
                os.fsync(fd)
            finally:
                os.close(fd)

    def replace(self, parts: Iterable[Part]) -> None:
        """Rewrite the journal to hold exactly `parts` (after dropping records that did not check out)."""
        with self._lock:
            write_atomic(self.path, b"".join(p.line() for p in parts))

    def drop(self, path: str) -> list[Part]:
        """Rewrite the journal without `path`'s records and return what is left, in one step under
        the lock: an append from another file's worker between the read and the rewrite would be lost."""
        with self._lock:
            kept = [p for p in self.load() if p.path != path]
            write_atomic(self.path, b"".join(p.line() for p in kept))
        return kept

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def hash_into(digest: Any, fd: int, offset: int, length: int) -> int:
    """Feed `length` bytes of an open file from `offset` to `digest`; return how many there were.

    Read into one reused buffer (preadv), not a fresh bytes object per chunk: what a pull hashes
    comes from the page cache at memory speed, where allocating and faulting in new 4 MiB buffers
    costs as much as copying into them.
    """
    buf = bytearray(min(CHUNK_BYTES, length))
    view = memoryview(buf)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(buf), length - done)]], offset + done)
        if not n:
            break
        digest.update(view[:n])
        done += n
    return done


def _lock_blocking(path: Path) -> int:
    """Open and flock `path`, retrying if the file we locked was removed meanwhile; return the fd."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)  # the holder removed it on release; lock the file now at the path


def _unlock(path: Path, fd: int) -> None:
    with suppress(FileNotFoundError):
        path.unlink()
    os.close(fd)  # closing the last descriptor releases the flock


@asynccontextmanager
async def exclusive(path: Path) -> AsyncIterator[None]:
    """Hold the flock on `path` for the block; wait for it without blocking the event loop.

    The wait runs on a thread of its own, not the default executor: a dozen pulls waiting there
    could take every worker and starve the very pull they wait for of its disk writes. If the
    waiting task is cancelled, the thread still gets the lock eventually, and lets it go at once.
    """
    done: concurrent.futures.Future[int] = concurrent.futures.Future()

    def wait() -> None:
        try:
            done.set_result(_lock_blocking(path))
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=wait, name=f"flock {path.name}", daemon=True).start()
    try:
        fd = await asyncio.shield(asyncio.wrap_future(done))
    except asyncio.CancelledError:
        done.add_done_callback(lambda f: f.exception() is None and _unlock(path, f.result()))
        raise
    try:
        yield
    finally:
        _unlock(path, fd)
