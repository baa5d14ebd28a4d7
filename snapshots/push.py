"""Push a snapshot from the store to object storage (`s3://bucket/prefix`): every file not already
there with the same size and sha256, large ones in multipart uploads, then the manifest last, so a
prefix whose push died halfway holds no manifest and is not a snapshot anyone can pull. Its bytes
are the stored manifest's own, so the id survives the round trip."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from snapshots.compile_cache import CompileCaches
from snapshots.compile_remote import push_caches
from snapshots.errors import (
    CorruptSnapshot,
    RemoteNotFound,
)
from snapshots.manifest import MANIFEST_NAME, FileEntry, Manifest
from snapshots.s3 import S3, RemoteConfig, S3Uri, connect
from snapshots.store import SnapshotStore
from snapshots.transfer import Meter, Progress, parts, run_all


@dataclass(frozen=True)
class PushReport:
    id: str
    uri: str
    files: int
    bytes_uploaded: int
    bytes_skipped: int  # already in the bucket with the same size and sha256
    seconds: float
    compile_caches: int = 0  # compile caches uploaded with it (snapshots.compile_remote)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def push(
    store: SnapshotStore, ref_or_id: str, uri: str, config: RemoteConfig, progress: Progress | None = None
) -> PushReport:
    """Upload a stored snapshot to `uri`; files already there (same size and sha256) are skipped."""
    started = time.monotonic()
    where = S3Uri.parse(uri)
    record = store.resolve(ref_or_id)
    raw = (record.path / MANIFEST_NAME).read_bytes()
    manifest = Manifest.from_json(raw)
    if manifest.snapshot_id != record.id:
        raise CorruptSnapshot(f"snapshot {record.id[:12]}'s manifest does not match its id: run verify")
    uploaded = skipped = 0
    meter = Meter(progress, manifest.total_bytes)
    with store.pin(record.id, holder=f"push {where}"):
        async with connect(config) as s3:
            sem = asyncio.Semaphore(config.concurrency)

            async def one(entry: FileEntry) -> None:
                nonlocal uploaded, skipped
                if await _already_there(s3, where, entry, sem):
                    skipped += entry.size
                    meter.add(entry.size)
                    return

                def part_done(n: int) -> None:
                    nonlocal uploaded
                    uploaded += n
                    meter.add(n)

                await put_file(s3, where, entry, record.path / entry.path, config, sem, part_done)

            await run_all(one(e) for e in manifest.files)
            # Last: until this lands, the prefix is not a snapshot.
            await s3.call(
                "put_object",
                f"PUT {where.url(MANIFEST_NAME)}",
                Bucket=where.bucket,
                Key=where.key(MANIFEST_NAME),
                Body=raw,
                ContentType="application/json",
            )
            caches = await push_caches(s3, where, CompileCaches(store.root), record.id)
    store.remember_remote(record.id, str(where))
    return PushReport(
        record.id,
        str(where),
        len(manifest.files),
        uploaded,
        skipped,
        time.monotonic() - started,
        caches.pushed,
    )


async def _already_there(s3: S3, where: S3Uri, entry: FileEntry, sem: asyncio.Semaphore) -> bool:
    async with sem:
        try:
            head = await s3.head(where.bucket, where.key(entry.path), f"HEAD {where.url(entry.path)}")
        except RemoteNotFound:
            return False  # no such key (or no such bucket: the PUT will say so)
    return head.get("ContentLength") == entry.size and head.get("Metadata", {}).get("sha256") == entry.sha256


async def put_file(
    s3: S3,
    where: S3Uri,
    entry: FileEntry,
    path: Path,
    config: RemoteConfig,
    sem: asyncio.Semaphore,
    part_done: Callable[[int], None] = lambda n: None,
) -> None:
    """Upload the local file `path` as `entry` (its key under `where`, size and sha256, kept as the
    object's `sha256` metadata): one PUT up to the part size, parallel parts above it. The batch
    API's files in object storage (`stoker.batch.objects`) go up the same way."""
    if entry.size <= config.part_size:
        async with sem:
            data = await asyncio.to_thread(_pread_all, path, 0, entry.size)
            await s3.call(
                "put_object",
                f"PUT {where.url(entry.path)}",
                Bucket=where.bucket,
                Key=where.key(entry.path),
                Body=data,
                Metadata={"sha256": entry.sha256},
            )
        part_done(entry.size)
        return
    await _multipart(s3, where, entry, path, config, sem, part_done)


async def _multipart(
    s3: S3,
    where: S3Uri,
    entry: FileEntry,
    path: Path,
    config: RemoteConfig,
    sem: asyncio.Semaphore,
    part_done: Callable[[int], None],
) -> None:
    """Upload one large file in parallel parts; abort the upload if any part fails."""
    url, key = where.url(entry.path), where.key(entry.path)
    created = await s3.call(
        "create_multipart_upload",
        f"start a multipart upload of {url}",
        Bucket=where.bucket,
        Key=key,
        Metadata={"sha256": entry.sha256},
    )
    upload_id = created["UploadId"]
    pieces = parts(entry.size, config.upload_part_size(entry.size))
    etags: dict[int, str] = {}

    async def upload(number: int, offset: int, length: int) -> None:
        async with sem:
            data = await asyncio.to_thread(_pread_all, path, offset, length)
            done = await s3.call(
                "upload_part",
                f"PUT part {number}/{len(pieces)} of {url}",
                Bucket=where.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
            )
        etags[number] = done["ETag"]
        part_done(length)

    try:
        await run_all(upload(i + 1, off, n) for i, (off, n) in enumerate(pieces))
        await s3.call(
            "complete_multipart_upload",
            f"complete the multipart upload of {url}",
            Bucket=where.bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"ETag": etags[n], "PartNumber": n} for n in sorted(etags)]},
        )
    except BaseException:
        # Parts of an upload never completed are billed until aborted. Retried like any call (an
        # abort racing the parts still in flight can meet a 5xx); errors are then ignored, since the
        # failure that got us here is the one to report.
        with suppress(Exception):
            await s3.call(
                "abort_multipart_upload",
                f"abort the multipart upload of {url}",
                Bucket=where.bucket,
                Key=key,
                UploadId=upload_id,
            )
        raise


def _pread_all(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise CorruptSnapshot(f"{path} is shorter than its manifest says: run verify")
    return data


# --- reading the manifest --------------------------------------------------------------------------
