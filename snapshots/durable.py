"""Durable file I/O for the store: copy while hashing, hash in chunks, fsync, atomic small writes.

Model weights run to many gigabytes, so nothing here reads a whole file into memory: every read is
a fixed-size chunk into one reused buffer. A file counts as written only once its bytes and its
directory entry have been fsynced.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from snapshots.errors import InvalidSource, StoreWriteError

# 4 MiB: large enough that per-call overhead vanishes next to sha256 (~1 GB/s on one core), small
# enough that the buffer is nothing beside the weights.
CHUNK_BYTES = 4 * 1024 * 1024
READ_BITS = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # a stored file's mode is at most these


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


def hash_file(path: Path) -> tuple[int, str]:
    """Return (size in bytes, sha256 hex) of `path`, read in chunks."""
    with open(path, "rb") as f:
        return hash_stream(f)


def hash_stream(f: BinaryIO) -> tuple[int, str]:
    """Return (size in bytes, sha256 hex) of what is left to read in `f`, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    while n := f.readinto(buf):
        digest.update(view[:n])
        size += n
    return size, digest.hexdigest()


def open_regular_nofollow(path: Path, expect: tuple[int, int] | None = None) -> int:
    """Open `path` read-only as the regular file it was checked to be; return the descriptor.

    The descriptor, not the name, is what gets read, so the checks are made on it: a symlink in the
    last component is refused by the kernel (`O_NOFOLLOW`), and `fstat` must show a regular file
    whose (dev, ino) is the one `lstat` saw at that path, and `expect` when given (the identity a
    scan approved earlier). A file swapped for a link or another file between a check and this open
    is caught here rather than copied. `O_NONBLOCK` only so that opening a fifo with no writer
    returns (to be refused) instead of blocking forever; reads of a regular file ignore it.
    Raises InvalidSource, naming the path.
    """
    try:
        before = os.lstat(path)
    except OSError as exc:
        raise InvalidSource(f"cannot read {path}: {_describe(exc)}") from exc
    if stat.S_ISLNK(before.st_mode):
        raise InvalidSource(f"refusing {path}: it is a symlink")
    if not stat.S_ISREG(before.st_mode):
        raise InvalidSource(f"refusing {path}: not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidSource(f"refusing {path}: it became a symlink while being read") from exc
        raise InvalidSource(f"cannot read {path}: {_describe(exc)}") from exc
    try:
        st = os.fstat(fd)
        opened = (st.st_dev, st.st_ino)
        if (
            not stat.S_ISREG(st.st_mode)
            or opened != (before.st_dev, before.st_ino)
            or expect not in (None, opened)
        ):
            raise InvalidSource(f"refusing {path}: it was replaced while being read")
    except BaseException:
        os.close(fd)
        raise
    return fd


def copy_hashing(src: Path, dst: Path, expect: tuple[int, int] | None = None) -> tuple[int, str]:
    """Copy `src` to a new file `dst`, hashing the bytes as they pass; fsync before returning.

    `src` is read through `open_regular_nofollow` (never through a symlink; `expect` is the
    (dev, ino) a scan approved), and `dst` gets no permission `src` lacks: its mode is the
    source's read bits, plus the owner's write bit while it is written (the store's commit takes
    that away again). Returns (size, sha256 hex). A read failure is the source's fault
    (InvalidSource); a write failure, disk full included, is the store's (StoreWriteError).
    """
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    fin = os.fdopen(open_regular_nofollow(src, expect), "rb")
    with fin:
        mode = (os.fstat(fin.fileno()).st_mode & READ_BITS) | stat.S_IWUSR
        try:
            fout = os.fdopen(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), "wb")
        except OSError as exc:
            raise StoreWriteError(f"cannot write {dst}: {_describe(exc)}") from exc
        with fout:
            while True:
                try:
                    n = fin.readinto(buf)
                except OSError as exc:
                    raise InvalidSource(f"cannot read {src}: {_describe(exc)}") from exc
                if not n:
                    break
                digest.update(view[:n])
                try:
                    fout.write(view[:n])
                except OSError as exc:
                    raise StoreWriteError(f"cannot write {dst}: {_describe(exc)}") from exc
                size += n
            try:
                fout.flush()
                os.fsync(fout.fileno())
            except OSError as exc:
                raise StoreWriteError(f"cannot write {dst}: {_describe(exc)}") from exc
    return size, digest.hexdigest()


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk, whoever wrote it (a read-only descriptor is enough on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the directory entries in `path` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that readers see either the old or the new content, never half.

    The temp file sits next to the target (same filesystem, so os.replace is a rename) under a
    hidden name; it is fsynced before the rename and the directory after it.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreWriteError(f"cannot write {path}: {_describe(exc)}") from exc
