"""Compile caches: an engine's torch.compile artifacts for one snapshot, kept beside it in the store.

vLLM spends most of its start compiling the model (SmolLM2 on this CPU: ~50 s of ~90 s). What it
compiles depends on the snapshot, vLLM's version and the engine arguments that shape the graph
(dtype, context length, parallelism, compilation settings), so that triple is the cache's key:

    key = sha256(canonical JSON of {"snapshot", "engine", "version", "args"})

Layout under the store root:

    compile/<snapshot id>/<key>/            a committed cache (what VLLM_CACHE_ROOT held after a
                                            start), with cache.json naming its key's inputs
    compile/<snapshot id>/.work-<host>-<pid>-<rnd>/   one instance's working copy, its VLLM_CACHE_ROOT
    compile/<snapshot id>/.tmp-<host>-<pid>-<rnd>/    a cache being committed or pulled

An instance starts from a copy of the committed cache (`checkout`), never from the committed one
itself, so two instances starting at once cannot see each other's half-written files; once it is
READY its copy is committed (`commit`) by a rename, if no cache of that key is committed yet. The
caches live and die with their snapshot: counted in its size for the store's budget, evicted and
removed with it (so a snapshot's pin protects them too), and gc clears the caches of snapshots
that are gone and the working copies of processes that are gone.

vLLM checks what it loads against its own, finer hash (its config, environment and source files),
so a cache that does not fit is recompiled, never misused: the key here only picks the bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from snapshots.durable import fsync_dir
from snapshots.errors import StoreWriteError
from snapshots.owner import is_stale, private_name
from snapshots.sizes import disk_bytes

COMPILE_DIR = "compile"
INFO_NAME = "cache.json"
WORK_PREFIX = ".work-"
TMP_PREFIX = ".tmp-"
_KEY = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CompileKey:
    snapshot_id: str
    engine: str  # "vllm"
    version: str  # the engine's version, "0.32.0+cpu"
    args: tuple[tuple[str, str], ...]  # the engine arguments that shape compilation, sorted

    @classmethod
    def of(cls, snapshot_id: str, engine: str, version: str, args: Mapping[str, str]) -> CompileKey:
        return cls(snapshot_id, engine, version, tuple(sorted((str(k), str(v)) for k, v in args.items())))

    def to_dict(self) -> dict[str, object]:
        return {
            "snapshot": self.snapshot_id,
            "engine": self.engine,
            "version": self.version,
            "args": dict(self.args),
        }

    @property
    def digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class CacheInfo:
    snapshot_id: str
    digest: str
    path: Path
    bytes: int
    key: dict[str, object]  # cache.json's content ({} if unreadable)


class CompileCaches:
    """The compile caches of one snapshot store. Cheap to construct; holds only the path."""

    def __init__(self, store_root: Path) -> None:
        self.root = Path(store_root) / COMPILE_DIR

    def snapshot_dir(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id

    def path(self, key: CompileKey) -> Path:
        return self.snapshot_dir(key.snapshot_id) / key.digest

    def has(self, key: CompileKey) -> bool:
        return (self.path(key) / INFO_NAME).is_file()

    def list(self, snapshot_id: str) -> list[CacheInfo]:
        out = []
        directory = self.snapshot_dir(snapshot_id)
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            return []
        for name in names:
            path = directory / name
            if not _KEY.fullmatch(name) or not path.is_dir() or path.is_symlink():
                continue
            try:
                key = json.loads((path / INFO_NAME).read_text())
            except (OSError, ValueError):
                key = {}
            out.append(
                CacheInfo(snapshot_id, name, path, disk_bytes(path), key if isinstance(key, dict) else {})
            )
        return out

    def bytes_of(self, snapshot_id: str) -> int:
        """Every byte kept for the snapshot's compiles, working copies included (they are on disk)."""
        directory = self.snapshot_dir(snapshot_id)
        return disk_bytes(directory) if directory.is_dir() else 0

    # --- an instance's copy ----------------------------------------------------------------------

    def checkout(self, key: CompileKey) -> tuple[Path, bool]:
        """A fresh working dir for one instance, seeded with the committed cache of `key` if there is
        one; returns it and whether it was seeded (a hit)."""
        directory = self.snapshot_dir(key.snapshot_id)
        work = directory / private_name(WORK_PREFIX)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            committed = self.path(key)
            if self.has(key):
                shutil.copytree(committed, work, symlinks=True)
                (work / INFO_NAME).unlink(missing_ok=True)
                return work, True
            work.mkdir()
            return work, False
        except OSError as exc:
            shutil.rmtree(work, ignore_errors=True)
            raise StoreWriteError(
                f"cannot prepare a compile cache in {directory}: {exc.strerror or exc}"
            ) from exc

    def commit(self, key: CompileKey, work: Path) -> bool:
        """Keep a copy of `work` as the committed cache of `key`, unless one is committed already.
        The instance goes on using `work`. Returns whether this call committed it."""
        if self.has(key):
            return False
        directory = self.snapshot_dir(key.snapshot_id)
        tmp = directory / private_name(TMP_PREFIX)
        try:
            shutil.copytree(work, tmp, symlinks=True)
            (tmp / INFO_NAME).write_text(json.dumps(key.to_dict(), indent=2, sort_keys=True) + "\n")
            return self.adopt(key, tmp)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreWriteError(
                f"cannot commit the compile cache {key.digest[:12]}: {exc.strerror or exc}"
            ) from exc

    def adopt(self, key: CompileKey, tmp: Path) -> bool:
        """Rename a complete cache dir (with its cache.json) in this snapshot's dir onto `key`'s
        place; if another got there first, drop it. Returns whether it was adopted."""
        target = self.path(key)
        try:
            os.rename(tmp, target)
        except OSError:  # ENOTEMPTY/EEXIST: committed meanwhile by another instance or a pull
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        fsync_dir(target.parent)
        return True

    def new_tmp(self, snapshot_id: str) -> Path:
        directory = self.snapshot_dir(snapshot_id)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / private_name(TMP_PREFIX)
        tmp.mkdir()
        return tmp

    @staticmethod
    def discard(work: Path) -> None:
        shutil.rmtree(work, ignore_errors=True)

    # --- upkeep ----------------------------------------------------------------------------------

    def remove(self, snapshot_id: str) -> Path | None:
        """Rename the snapshot's caches to `trash_dir`-style hidden name for deletion; the caller
        deletes the returned dir. None if it had none."""
        directory = self.snapshot_dir(snapshot_id)
        trash = self.root / f".trash-{secrets.token_hex(8)}"
        try:
            os.rename(directory, trash)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreWriteError(f"cannot remove the compile caches of {snapshot_id[:12]}: {exc}") from exc
        return trash

    def leftovers(self, present: set[str]) -> list[Path]:
        """What gc may delete: the caches of snapshots no longer in the store, trash, and working or
        temp copies whose process (on this host) is gone."""
        out: list[Path] = []
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return out
        for name in names:
            path = self.root / name
            if name.startswith(".trash-") or (_KEY.fullmatch(name) and name not in present):
                out.append(path)
            elif _KEY.fullmatch(name) and path.is_dir():
                out += [
                    path / inner
                    for inner in sorted(os.listdir(path))
                    if is_stale(inner, WORK_PREFIX) or is_stale(inner, TMP_PREFIX)
                ]
        return out
