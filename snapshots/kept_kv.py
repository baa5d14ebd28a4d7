"""Kept KV: the prefix-cache blocks an engine wrote for one snapshot, kept beside it in the store.

Layout under the store root:

    kv/<snapshot id>/<key digest>.kv     one engine configuration's kept blocks, in one scope
                                         (`stoker.engine.kv_keep` writes and reads them)
    kv/<snapshot id>/.tmp-<host>-<pid>-<rnd>   one being written (renamed onto its name when whole)
    kv/.trash-<rnd>/                     a snapshot's kept KV being deleted

The store owns the directories and nothing inside the files: what they mean, and whether one can
be trusted, is the engine's to check. They live and die with their snapshot, as its compile caches
do: counted in its size for the store's budget, removed when it is evicted or removed, and gc
clears those of snapshots that are gone.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from snapshots.errors import StoreWriteError
from snapshots.owner import is_stale
from snapshots.sizes import disk_bytes

KV_DIR = "kv"
TMP_PREFIX = ".tmp-"
# What one deployment keeps per snapshot and engine configuration by default (`stoker engine
# --kv-keep-bytes`): SmolLM2-135M in fp32 holds 45 KiB of KV a token, so ~5,800 tokens.
DEFAULT_BYTES = 256 << 20
_ID = re.compile(r"[0-9a-f]{64}")


class KeptKv:
    """The kept KV of one snapshot store. Cheap to construct; holds only the path."""

    def __init__(self, store_root: Path) -> None:
        self.root = Path(store_root) / KV_DIR

    def snapshot_dir(self, snapshot_id: str) -> Path:
        if not _ID.fullmatch(snapshot_id):
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        return self.root / snapshot_id

    def bytes_of(self, snapshot_id: str) -> int:
        directory = self.snapshot_dir(snapshot_id)
        return disk_bytes(directory) if directory.is_dir() else 0

    def remove(self, snapshot_id: str) -> Path | None:
        """Rename the snapshot's kept KV to a hidden trash name; the caller deletes the returned dir.
        None if it had none."""
        trash = self.root / f".trash-{secrets.token_hex(8)}"
        try:
            os.rename(self.snapshot_dir(snapshot_id), trash)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreWriteError(f"cannot remove the kept KV of {snapshot_id[:12]}: {exc}") from exc
        return trash

    def leftovers(self, present: set[str]) -> list[Path]:
        """What gc may delete: the kept KV of snapshots no longer in the store, trash, and files
        whose writer (a process on this host) died before renaming them."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        out: list[Path] = []
        for name in names:
            path = self.root / name
            if name.startswith(".trash-") or (_ID.fullmatch(name) and name not in present):
                out.append(path)
            elif _ID.fullmatch(name) and path.is_dir() and not path.is_symlink():
                out += [path / inner for inner in sorted(os.listdir(path)) if is_stale(inner, TMP_PREFIX)]
        return out
