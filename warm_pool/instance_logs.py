"""Reading the local backend's instance logs (`<log dir>/<instance id>.log`) for `stoker logs`.

Every read is bounded: a tail reads at most the file's last `TAIL_BYTES` and keeps at most
`MAX_TAIL_LINES` lines of them, a follow reads at most `CHUNK_BYTES` at a time from where it got
to. A log is opened without following links (`snapshots.durable.open_regular_nofollow`: the last
component may not be a symlink, and the descriptor must be the regular file `lstat` saw), so a link
planted in the log directory cannot make the admin API read another file. Lines are redacted as
failure records are (`warm_pool.failures.redact`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from snapshots.durable import open_regular_nofollow
from snapshots.errors import InvalidSource
from warm_pool.errors import PoolError
from warm_pool.failures import redact

MAX_TAIL_LINES = 10_000
TAIL_BYTES = 4 << 20  # 10,000 lines of 400 bytes
CHUNK_BYTES = 64 << 10


class LogUnreadable(PoolError):
    """The log exists but may not or cannot be read (a symlink, not a regular file, no permission)."""


def instance_pattern(deployment: str) -> re.Pattern[str]:
    """The ids the pool gives a deployment's instances (`states.new_instance_id`)."""
    return re.compile(rf"{re.escape(deployment)}-[0-9a-f]{{8}}")


def logged_instances(log_dir: Path, deployment: str) -> list[str]:
    """The deployment's instances that have a log, least recently written first."""
    pattern = instance_pattern(deployment)
    found: list[tuple[float, str]] = []
    try:
        entries = list(os.scandir(log_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        stem = entry.name.removesuffix(".log")
        if stem != entry.name and pattern.fullmatch(stem) and entry.is_file(follow_symlinks=False):
            try:
                found.append((entry.stat(follow_symlinks=False).st_mtime, stem))
            except FileNotFoundError:
                continue
    return [stem for _, stem in sorted(found)]


def open_log(path: Path) -> int | None:
    """A read-only descriptor on the log at `path`; None if there is none; `LogUnreadable` if it is not
    a regular file of its own (a symlink, say)."""
    try:
        return open_regular_nofollow(path)
    except InvalidSource as exc:
        if not os.path.lexists(path):
            return None
        raise LogUnreadable(str(exc)) from None


def read_tail(fd: int, lines: int) -> tuple[bytes, int]:
    """The last `lines` lines (at most MAX_TAIL_LINES, within the last TAIL_BYTES), and the offset
    they end at, where a follow goes on from. A last line without its newline yet is left for the
    follow; one that started before the bytes read is dropped, as a partial line."""
    end = os.fstat(fd).st_size
    start = max(0, end - TAIL_BYTES)
    data = os.pread(fd, end - start, start)
    if start > 0:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    complete = data.rfind(b"\n") + 1
    kept = data[:complete].splitlines(keepends=True)
    lines = min(max(0, lines), MAX_TAIL_LINES)
    return b"".join(kept[len(kept) - lines :] if lines else []), end - (len(data) - complete)


def read_more(fd: int, offset: int) -> bytes:
    """Up to CHUNK_BYTES written since `offset`."""
    return os.pread(fd, CHUNK_BYTES, offset)


def redact_lines(data: bytes) -> bytes:
    """`data` (whole lines) with what looks like a credential redacted, line by line."""
    if not data:
        return data
    text = data.decode("utf-8", "replace")
    return "".join(redact(line) for line in text.splitlines(keepends=True)).encode()
