"""The page-cache tier: read a snapshot's files into the OS page cache, measure what is there, drop it.

A start whose snapshot is in the page cache loads at memory speed instead of disk speed (`dd` here:
7.3-7.7 GB/s from the page cache, 1.6-2.7 GB/s from cold disk, sometimes 0.7), so the scaler warms
a snapshot when it expects a start, and `stoker snapshot warm` does it by hand.

- `warm` asks the kernel for readahead of each whole file (`POSIX_FADV_WILLNEED`, `SEQUENTIAL`),
  then reads it front to back through one reused buffer: the advice alone is not a promise that
  every page arrives, and the read is. Memory used: the buffer (16 MiB), whatever the file sizes.
- `residency` maps each file read-only and asks `mincore(2)` which of its pages are cached. Mapping
  faults nothing in, so measuring does not change the answer.
- `drop` writes back dirty pages, then advises `POSIX_FADV_DONTNEED`. The kernel drops only clean
  pages that no process maps: it cannot evict pages another process has mapped (a running engine's
  memory-mapped weights stay cached until that engine lets go of them), and on tmpfs the page
  cache is the file itself, so nothing is dropped there at all.

Every path may be one file or a snapshot directory (every regular file under it, symlinks skipped).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from snapshots.errors import SnapshotError, SnapshotNotFound

CHUNK_BYTES = 16 << 20  # dd's bs=16M reads at the disk's full speed here; larger buys nothing
PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore's other bits are reserved: mask them off


class PageCacheError(SnapshotError):
    """A snapshot file that exists but cannot be read, mapped or advised (permissions, I/O error)."""


@dataclass(frozen=True)
class WarmReport:
    bytes: int  # read into the page cache
    seconds: float
    files: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def warm(
    path: Path | str, *, chunk_bytes: int = CHUNK_BYTES, clock: Callable[[], float] = time.perf_counter
) -> WarmReport:
    """Read every file under `path` into the page cache, sequentially, through one reused buffer."""
    files = snapshot_files(path)
    view = memoryview(bytearray(chunk_bytes))
    total = 0
    t0 = clock()
    for file in files:
        with _opened(file) as fd:
            _advise(fd, file, os.POSIX_FADV_SEQUENTIAL)  # doubles the kernel's readahead window
            _advise(fd, file, os.POSIX_FADV_WILLNEED)  # starts readahead of the whole file now
            while n := _read(fd, file, view):
                total += n
    return WarmReport(bytes=total, seconds=clock() - t0, files=len(files))


def residency(path: Path | str) -> float:
    """The fraction of the bytes under `path` that are in the page cache (1.0 when there are none)."""
    total = resident = 0
    for file in snapshot_files(path):
        size, cached = _resident_bytes(file)
        total += size
        resident += cached
    return resident / total if total else 1.0


def drop(path: Path | str) -> None:
    """Ask the kernel to drop every file under `path` from the page cache.

    Only clean pages that no process maps go: pages another process maps stay (a running engine's
    weights), so `residency` after a drop is the measure of what actually left.
    """
    for file in snapshot_files(path):
        with _opened(file) as fd:
            try:
                os.fdatasync(fd)  # DONTNEED skips dirty pages: a freshly written file needs this first
            except OSError as exc:
                raise PageCacheError(f"cannot write back {file}: {exc.strerror}") from None
            _advise(fd, file, os.POSIX_FADV_DONTNEED)


def snapshot_files(path: Path | str) -> list[Path]:
    """`path` itself if it is a file, else every regular file under it, in a stable order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise SnapshotNotFound(f"no such file or directory: {path}")
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())


# ---- system calls, with their errors translated --------------------------------------------------------


class _opened:
    """A read-only file descriptor as a context manager; a missing file is SnapshotNotFound."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> int:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # removed since it was listed: evicted or garbage-collected
            raise SnapshotNotFound(f"{self.path} disappeared (evicted or removed)") from None
        except OSError as exc:
            raise PageCacheError(f"cannot open {self.path}: {exc.strerror}") from None
        return self.fd

    def __exit__(self, *exc_info) -> None:
        os.close(self.fd)


def _advise(fd: int, path: Path, advice: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except OSError as exc:
        raise PageCacheError(f"posix_fadvise on {path} failed: {exc.strerror}") from None


def _read(fd: int, path: Path, view: memoryview) -> int:
    try:
        return os.readv(fd, [view])
    except OSError as exc:
        raise PageCacheError(f"cannot read {path}: {exc.strerror}") from None


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def _resident_bytes(path: Path) -> tuple[int, int]:
    """(size, bytes in the page cache) of one file, by mincore(2) on a read-only shared mapping."""
    with _opened(path) as fd:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        libc = _libc()
        # Python's mmap module hides a read-only mapping's address, and mincore needs it: map here.
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise PageCacheError(f"cannot map {path}: {os.strerror(ctypes.get_errno())}")
        try:
            pages = -(-size // PAGE)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                raise PageCacheError(f"mincore on {path} failed: {os.strerror(ctypes.get_errno())}")
            bits = vec.raw.translate(_LOW_BIT)
        finally:
            libc.munmap(addr, size)
    resident = bits.count(1) * PAGE
    if bits[-1]:  # the last page is only partly the file's
        resident -= pages * PAGE - size
    return size, resident
