"""The batch API's files on disk: written atomically, opened without following links.

Every directory is made 0700 and refused if it is a symbolic link (`O_NOFOLLOW` guards a file's
name, not its directory's); every file is opened with `O_NOFOLLOW` and checked to be a regular
file on its descriptor. A small file (a record, a file's metadata) is replaced whole: a hidden
temp file beside it, written, fsynced, renamed over the old one, the directory fsynced, as
`stoker.control.checkpoint` writes its checkpoints; a crash mid-write leaves the old one whole.
What goes wrong becomes `DiskError`, whose message names the file but no secret.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

TEMP = ".tmp-"  # the prefix of every temp file; a start sweeps those a killed run left


class DiskError(Exception):
    """A batch file that could not be read or written, or is not what it should be."""


def ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise DiskError(f"cannot make {path}: {exc.strerror or exc}") from None
    if path.is_symlink() or not path.is_dir():
        raise DiskError(f"{path} is a symbolic link or not a directory (links are not followed)")
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_beside(path: Path) -> Path:
    return path.with_name(f"{TEMP}{path.name}-{secrets.token_hex(4)}")


def create_new(path: Path) -> int:
    """A new file at `path` (0600, never through a link), open for writing: its descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except OSError as exc:
        raise DiskError(f"cannot create {path}: {exc.strerror or exc}") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: readers see the old content or the new, never half."""
    tmp = temp_beside(path)
    fd = create_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise DiskError(f"cannot write {path}: {exc.strerror or exc}") from None


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int | None:
    """`path` opened without following a link (None if it does not exist), checked regular."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DiskError(f"{path} is a symbolic link (links are not followed)") from None
        raise DiskError(f"cannot open {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DiskError(f"{path} is not a regular file")
    return fd


def read_small(path: Path, max_bytes: int) -> bytes | None:
    """The whole of a small file (None if it does not exist), refused past `max_bytes`."""
    fd = open_regular(path)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise DiskError(f"{path} is over its bound of {max_bytes} bytes")
    return data


def sweep_temps(directory: Path) -> None:
    """The temp files a killed run left in `directory` (their names are hidden)."""
    with contextlib.suppress(OSError):
        for left in directory.glob(f"{TEMP}*"):
            with contextlib.suppress(OSError):
                left.unlink()
