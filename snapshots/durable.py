"""Durable file I/O for the store: copy while hashing, hash in chunks, fsync, atomic small writes.

Model weights run to many gigabytes, so nothing here reads a whole file into memory: every read is
a fixed-size chunk into one reused buffer. A file counts as written only once its bytes and its
directory entry have been fsynced.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from snapshots.errors import InvalidSource, StoreWriteError

# 4 MiB: large enough that per-call overhead vanishes next to sha256 (~1 GB/s on one core), small
# enough that the buffer is nothing beside the weights.
CHUNK_BYTES = 4 * 1024 * 1024


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


def hash_file(path: Path) -> tuple[int, str]:
    """Return (size in bytes, sha256 hex) of `path`, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy `src` to a new file `dst`, hashing the bytes as they pass; fsync before returning.

    Returns (size, sha256 hex). A read failure is the source's fault (InvalidSource); a write
    failure, disk full included, is the store's (StoreWriteError).
    """
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    try:
        fin = open(src, "rb")
    except OSError as exc:
        raise InvalidSource(f"cannot read {src}: {_describe(exc)}") from exc
    with fin:
        try:
            fout = open(dst, "xb")
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
