"""Integrity check of a snapshot directory against its manifest.

Every listed file is looked up, its size compared (cheap, catches truncation) and its bytes
re-hashed in chunks; files on disk that the manifest does not list are reported too, since an
engine would load a stray `*.safetensors` just the same. The manifest itself must hash to the id
the directory is named after.

`check_dir` is the same check for an instance about to start, made cheap by trusting what was
hashed before: a file whose (size, mtime_ns, ctime_ns, inode) is the one recorded when it last
hashed sound is not hashed again (its size is still compared). Writing a file changes its mtime
and ctime, and nothing but the kernel sets ctime (`touch -d` cannot put it back), so a file
changed since is hashed again; a chmod or a new hard link also moves ctime, which costs one hash.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from snapshots.durable import hash_stream, open_regular_nofollow
from snapshots.errors import SnapshotError
from snapshots.manifest import MANIFEST_NAME, Manifest


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one file of a snapshot."""

    path: str  # relative to the snapshot dir
    kind: str  # "missing" | "size" | "corrupt" | "unexpected" | "manifest"
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}"


# What a file looked like when it last hashed sound: (size, mtime_ns, ctime_ns, inode).
FileStat = tuple[int, int, int, int]


def file_stat(st: os.stat_result) -> FileStat:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def verify_dir(snapshot_dir: Path, expected_id: str) -> list[Problem]:
    """Return every problem found in `snapshot_dir`; an empty list means the snapshot is sound."""
    return check_dir(snapshot_dir, expected_id, {})[0]


def check_dir(
    snapshot_dir: Path, expected_id: str, trusted: Mapping[str, FileStat]
) -> tuple[list[Problem], dict[str, FileStat]]:
    """`verify_dir`, hashing only the files whose stat is not the one `trusted` holds for them.

    Returns the problems and, for every file that is sound, its stat to trust next time.
    """
    sound: dict[str, FileStat] = {}
    try:
        manifest = Manifest.from_json((snapshot_dir / MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        return [Problem(MANIFEST_NAME, "missing", "missing")], sound
    except (OSError, SnapshotError) as exc:
        return [Problem(MANIFEST_NAME, "manifest", f"unreadable: {exc}")], sound

    problems = []
    if manifest.snapshot_id != expected_id:
        problems.append(
            Problem(
                MANIFEST_NAME, "manifest", f"describes snapshot {manifest.snapshot_id[:12]}, not this one"
            )
        )
    for entry in manifest.files:
        path = snapshot_dir / entry.path
        try:
            st = os.lstat(path)
        except OSError:
            problems.append(Problem(entry.path, "missing", "missing"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(Problem(entry.path, "missing", "missing (not a regular file)"))
            continue
        if st.st_size != entry.size:
            problems.append(Problem(entry.path, "size", f"size {st.st_size} bytes, expected {entry.size}"))
            continue
        if trusted.get(entry.path) == file_stat(st):
            sound[entry.path] = file_stat(st)
            continue
        try:
            with os.fdopen(open_regular_nofollow(path), "rb") as f:
                seen = file_stat(os.fstat(f.fileno()))  # before reading: a write meanwhile moves it
                size, digest = hash_stream(f)
        except (OSError, SnapshotError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            problems.append(Problem(entry.path, "missing", f"unreadable: {detail}"))
            continue
        if size != entry.size:
            problems.append(Problem(entry.path, "size", f"size {size} bytes, expected {entry.size}"))
        elif digest != entry.sha256:
            problems.append(Problem(entry.path, "corrupt", "corrupt: sha256 does not match the manifest"))
        else:
            sound[entry.path] = seen

    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    for dirpath, _dirnames, filenames in os.walk(snapshot_dir):
        for filename in filenames:
            rel = (Path(dirpath) / filename).relative_to(snapshot_dir).as_posix()
            if rel not in listed:
                problems.append(Problem(rel, "unexpected", "not listed in the manifest"))
    return problems, sound
