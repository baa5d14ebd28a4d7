"""Compile caches in object storage, beside their snapshot: pushed with it, pulled with it.

Layout under the snapshot's prefix:

    prefix/compile/<key>.tar     the cache dir as a tar: sorted names, zero mtimes and owners, so the
                                 same cache gives the same bytes (and the same sha256) on every push
    prefix/compile/<key>.json    its key's inputs plus the tar's size and sha256; written last, so a
                                 half-pushed cache has no index and is never pulled

A pull lists `compile/*.json`, and for each cache of this snapshot it does not keep yet: checks that
the index names this snapshot and that the key's inputs hash to the key, GETs the tar (bounded by
the size the index gives), checks its sha256, unpacks it with tarfile's `data` filter (no absolute
paths, no links out of the dir, no devices) into a hidden temp dir of the store, and renames it into
place. Caches only save time: a cache that fails any of this is skipped with a warning, and the
snapshot is served all the same (vLLM compiles, as it would without one).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import tarfile
from dataclasses import dataclass
from pathlib import Path

from snapshots.compile_cache import INFO_NAME, CompileCaches, CompileKey
from snapshots.errors import RemoteNotFound, SnapshotError
from snapshots.s3 import S3, RemoteConfig, S3Uri, connect

log = logging.getLogger("stoker.snapshots")

PREFIX = "compile/"
MAX_CACHE_BYTES = 1 << 30  # vLLM's caches: ~6 MB for SmolLM2 on CPU, hundreds of MB for big GPU models
MAX_INDEX_BYTES = 64 * 1024


@dataclass(frozen=True)
class CacheTransfer:
    pushed: int = 0  # caches uploaded
    pulled: int = 0  # caches downloaded and kept
    skipped: int = 0  # already there (same bytes), or already kept here
    failed: int = 0  # each with a warning in the log


def pack(directory: Path) -> bytes:
    """The cache dir as a reproducible tar (cache.json left out: the index carries the key)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(directory.rglob("*")):
            rel = path.relative_to(directory).as_posix()
            if rel == INFO_NAME or path.is_symlink():
                continue
            info = tar.gettarinfo(str(path), arcname=rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_file():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def unpack(data: bytes, into: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(into, filter="data")


async def push_caches(s3: S3, where: S3Uri, caches: CompileCaches, snapshot_id: str) -> CacheTransfer:
    pushed = skipped = failed = 0
    for info in caches.list(snapshot_id):
        if not info.key:
            continue  # no readable cache.json: not a committed cache
        try:
            if info.bytes > MAX_CACHE_BYTES:  # before the tar is built in memory
                raise SnapshotError(f"{info.bytes} bytes, over the {MAX_CACHE_BYTES} limit")
            data = await asyncio.to_thread(pack, info.path)
            if len(data) > MAX_CACHE_BYTES:
                raise SnapshotError(f"{len(data)} bytes, over the {MAX_CACHE_BYTES} limit")
            sha = hashlib.sha256(data).hexdigest()
            index = json.dumps({**info.key, "size": len(data), "sha256": sha}, sort_keys=True).encode()
            tar_key, index_key = f"{PREFIX}{info.digest}.tar", f"{PREFIX}{info.digest}.json"
            try:
                head = await s3.head(where.bucket, where.key(tar_key), f"HEAD {where.url(tar_key)}")
                there = head.get("Metadata", {}).get("sha256") == sha
            except RemoteNotFound:
                there = False
            if there:
                skipped += 1
            else:
                await s3.call(
                    "put_object",
                    f"PUT {where.url(tar_key)}",
                    Bucket=where.bucket,
                    Key=where.key(tar_key),
                    Body=data,
                    Metadata={"sha256": sha},
                )
                pushed += 1
            await s3.call(  # last, and always: the index names what the tar holds
                "put_object",
                f"PUT {where.url(index_key)}",
                Bucket=where.bucket,
                Key=where.key(index_key),
                Body=index,
                ContentType="application/json",
            )
        except (SnapshotError, OSError) as exc:
            failed += 1
            log.warning("compile cache %s not pushed to %s: %s", info.digest[:12], where, exc)
    return CacheTransfer(pushed=pushed, skipped=skipped, failed=failed)


async def pull_caches(s3: S3, where: S3Uri, caches: CompileCaches, snapshot_id: str) -> CacheTransfer:
    pulled = skipped = failed = 0
    try:
        listing = await s3.call(
            "list_objects_v2",
            f"LIST {where.url(PREFIX)}",
            Bucket=where.bucket,
            Prefix=where.key(PREFIX),
            MaxKeys=1000,
        )
    except SnapshotError as exc:
        log.warning("compile caches of %s not listed: %s", where, exc)
        return CacheTransfer(failed=1)
    for obj in listing.get("Contents", []):
        name = obj["Key"].rsplit("/", 1)[-1]
        if not name.endswith(".json"):
            continue
        digest = name.removesuffix(".json")
        try:
            key, size, sha = await _read_index(s3, where, digest, snapshot_id)
            if caches.has(key):
                skipped += 1
                continue
            data = await _get(s3, where, f"{PREFIX}{digest}.tar", size)
            if hashlib.sha256(data).hexdigest() != sha:
                raise SnapshotError("its tar does not match the sha256 its index gives")
            await asyncio.to_thread(_keep, caches, key, data)
            pulled += 1
        except (SnapshotError, OSError, tarfile.TarError, ValueError) as exc:
            failed += 1
            log.warning("compile cache %s from %s skipped: %s", digest[:12], where, exc)
    return CacheTransfer(pulled=pulled, skipped=skipped, failed=failed)


def _keep(caches: CompileCaches, key: CompileKey, data: bytes) -> None:
    tmp = caches.new_tmp(key.snapshot_id)
    try:
        unpack(data, tmp)
        (tmp / INFO_NAME).write_text(json.dumps(key.to_dict(), indent=2, sort_keys=True) + "\n")
    except BaseException:
        caches.discard(tmp)
        raise
    caches.adopt(key, tmp)


async def _read_index(s3: S3, where: S3Uri, digest: str, snapshot_id: str) -> tuple[CompileKey, int, str]:
    doc = json.loads(await _get(s3, where, f"{PREFIX}{digest}.json", MAX_INDEX_BYTES))
    if not isinstance(doc, dict) or doc.get("snapshot") != snapshot_id:
        raise SnapshotError("its index names another snapshot")
    args = doc.get("args")
    if not isinstance(args, dict) or not all(isinstance(v, str) for v in args.values()):
        raise SnapshotError("its index has no valid args")
    key = CompileKey.of(snapshot_id, str(doc.get("engine")), str(doc.get("version")), args)
    if key.digest != digest:
        raise SnapshotError("its index does not hash to its name")
    size, sha = doc.get("size"), doc.get("sha256")
    if not isinstance(size, int) or not 0 < size <= MAX_CACHE_BYTES or not isinstance(sha, str):
        raise SnapshotError(f"its size {size!r} is not in 1..{MAX_CACHE_BYTES}, or it has no sha256")
    return key, size, sha


async def _get(s3: S3, where: S3Uri, key: str, limit: int) -> bytes:
    async def get() -> bytes:
        resp = await s3.client.get_object(Bucket=where.bucket, Key=where.key(key))
        async with resp["Body"] as body:
            if resp.get("ContentLength", 0) > limit:
                raise SnapshotError(f"{where.url(key)} is {resp['ContentLength']} bytes, over {limit}")
            return await body.read()

    return await s3.run(get, f"GET {where.url(key)}")


async def upload(caches: CompileCaches, snapshot_id: str, uri: str, config: RemoteConfig) -> CacheTransfer:
    """Push the snapshot's kept compile caches to its object storage (what a pool does when one of
    its instances compiled a snapshot it pulled, so that the next node's first start does not)."""
    where = S3Uri.parse(uri)
    async with connect(config) as s3:
        return await push_caches(s3, where, caches, snapshot_id)
