"""Integrity check of a snapshot directory against its manifest.

Every listed file is looked up, its size compared (cheap, catches truncation) and its bytes
re-hashed in chunks; files on disk that the manifest does not list are reported too, since an
engine would load a stray `*.safetensors` just the same. The manifest itself must hash to the id
the directory is named after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from snapshots.durable import hash_file
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


def verify_dir(snapshot_dir: Path, expected_id: str) -> list[Problem]:
    """Return every problem found in `snapshot_dir`; an empty list means the snapshot is sound."""
    try:
        manifest = Manifest.from_json((snapshot_dir / MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        return [Problem(MANIFEST_NAME, "missing", "missing")]
    except (OSError, SnapshotError) as exc:
        return [Problem(MANIFEST_NAME, "manifest", f"unreadable: {exc}")]

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
            if path.is_symlink() or not path.is_file():
                problems.append(Problem(entry.path, "missing", "missing"))
                continue
            size = path.stat().st_size
            if size != entry.size:
                problems.append(Problem(entry.path, "size", f"size {size} bytes, expected {entry.size}"))
                continue
            _, digest = hash_file(path)
        except OSError as exc:
            problems.append(Problem(entry.path, "missing", f"unreadable: {exc.strerror or exc}"))
            continue
        if digest != entry.sha256:
            problems.append(Problem(entry.path, "corrupt", "corrupt: sha256 does not match the manifest"))

    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    for dirpath, _dirnames, filenames in os.walk(snapshot_dir):
        for filename in filenames:
            rel = (Path(dirpath) / filename).relative_to(snapshot_dir).as_posix()
            if rel not in listed:
                problems.append(Problem(rel, "unexpected", "not listed in the manifest"))
    return problems
