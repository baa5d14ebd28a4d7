"""A tenant's files (`/v1/files`): uploaded batch inputs and the batches' output and error files.

    <data dir>/files/<tenant>/file-<24 hex>        the bytes, as uploaded (or as a batch wrote them)
    <data dir>/files/<tenant>/file-<24 hex>.json   its File object: filename, purpose, bytes, created_at

A file exists once its metadata does: an upload is streamed into a hidden temp file (0600, created
with `O_EXCL | O_NOFOLLOW`), fsynced, renamed to its name, and then its metadata is written
atomically (`stoker.batch.disk`); a delete removes the metadata first. So a listing never shows a
half-written file, and a crash leaves at most a temp file (swept at the next start) or bytes
without metadata (swept too, unless an unfinished batch is about to adopt them).

Where object storage is configured (`stoker up --files-store`, `stoker.batch.objects`), the bytes
go to the bucket once they are durable here, and the metadata records it (`stored: "s3"`). The
metadata is then also the journal of what is in the bucket: it is written `uploading` before the
put and `deleting` before the delete, so a crash in between leaves a record the next start
finishes (`sweep_objects`): an object no metadata describes is never left behind.

Each tenant has a directory of its own and sees only it: the admin's is `_admin`, which no tenant
name can be (tenant names start with a letter or digit, `stoker.spec.keys.TENANT`). Ids are checked
against their pattern before any path is made of them. The number of files a tenant keeps is
bounded (`BatchConfig.max_files`), and each upload's size (`upload_limit_bytes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapshots.durable import hash_stream
from snapshots.errors import RemoteError
from stoker.batch.disk import (
    DiskError,
    create_new,
    ensure_dir,
    fsync_dir,
    open_regular,
    read_small,
    sweep_temps,
    temp_beside,
    write_atomic,
)
from stoker.spec.keys import TENANT, Principal

if TYPE_CHECKING:
    from stoker.batch.objects import FileObjects

log = logging.getLogger("stoker.batch")
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
ADMIN_OWNER = "_admin"
UPLOAD_PURPOSES = ("batch",)  # what `POST /v1/files` takes; "batch_output" is the batches' own
MAX_FILENAME = 255
META_BYTES = 4096
READ_CHUNK = 1 << 20
LOCAL, S3 = "local", "s3"  # where a file's bytes are
READY, UPLOADING, DELETING = "ready", "uploading", "deleting"  # a file's state; only READY is shown


def owner_of(principal: Principal) -> str:
    """Whose files and batches a caller sees: its key's tenant, or the admin's own."""
    if principal.admin or not principal.tenant:
        return ADMIN_OWNER
    return principal.tenant


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


@dataclass(frozen=True)
class FileObject:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    sha256: str | None = None  # of the bytes, checked when a copy is fetched from the bucket
    stored: str = LOCAL
    state: str = READY

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


class Upload:
    """One upload on its way in: bytes appended to a hidden temp file, then `commit` or `abort`."""

    def __init__(self, store: FileStore, owner: str, limit: int) -> None:
        self.store, self.owner, self.limit = store, owner, limit
        self.id = new_file_id()
        self.final = store.dir_of(owner) / self.id
        self.path = temp_beside(self.final)
        self._fd: int | None = create_new(self.path)
        self.size = 0
        self._digest = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise OverLimit(self.limit)
        self._digest.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view) :]

    def finish(self) -> str:
        """The bytes made durable under their name (no file yet: no metadata); their sha256."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.path, self.final)
        fsync_dir(self.final.parent)
        return self._digest.hexdigest()

    async def commit(self, filename: str, purpose: str) -> FileObject:
        """The bytes made durable, put where the store keeps them, then the metadata that makes
        them a file."""
        sha256 = await asyncio.to_thread(self.finish)
        return await self.store.publish(self.owner, self.id, self.size, sha256, filename, purpose)

    def abort(self) -> None:
        """Nothing of it left: the temp file, or the bytes `finish` made durable."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for path in (self.path, self.final):
            with contextlib.suppress(OSError):
                path.unlink()


class OverLimit(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"over {limit} bytes")
        self.limit = limit


class FileStore:
    def __init__(
        self,
        root: Path,
        max_files: int,
        clock: Callable[[], float] = time.time,
        objects: FileObjects | None = None,
    ) -> None:
        self.root = root
        self.max_files = max_files
        self._clock = clock
        self.objects = objects  # None: the bytes stay in the data dir

    def dir_of(self, owner: str) -> Path:
        if owner != ADMIN_OWNER and not TENANT.fullmatch(owner):
            raise ValueError(f"not an owner: {owner!r}")
        return ensure_dir(self.root / owner)

    def sweep(self, keep: Iterable[str] = ()) -> None:
        """At start: temp files, and bytes without metadata unless an unfinished batch names them."""
        if not self.root.is_dir():
            return
        keep = set(keep)
        for owner in self.root.iterdir():
            if owner.is_symlink() or not owner.is_dir():
                continue
            sweep_temps(owner)
            for path in owner.iterdir():
                if FILE_ID.fullmatch(path.name) and path.name not in keep:
                    if not path.with_name(path.name + ".json").exists():
                        with contextlib.suppress(OSError):
                            path.unlink()

    async def sweep_objects(self, keep: Iterable[str] = ()) -> int:
        """At start, where the bytes go to a bucket: what a crash left half done there. A file
        `uploading` is removed (its object too, unless an unfinished batch is about to publish it
        again), one `deleting` is deleted. How many were finished; one the store fails is left
        journalled for the next start, which a store that is down does not stop."""
        if self.objects is None or not self.root.is_dir():
            return 0
        keep, n = set(keep), 0
        for owner_dir in sorted(self.root.iterdir()):
            if owner_dir.is_symlink() or not owner_dir.is_dir():
                continue
            owner = owner_dir.name
            for meta_path in sorted(owner_dir.glob("file-*.json")):
                file_id = meta_path.name[: -len(".json")]
                meta = self._read(owner, file_id)
                if meta is None or meta.state == READY:
                    continue
                if file_id not in keep:
                    try:
                        await self.objects.delete(owner, file_id)
                    except RemoteError as exc:  # a store that is down must not stop the start
                        log.warning(
                            "%s is still journalled %s: %s; again at the next start", file_id, meta.state, exc
                        )
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        (owner_dir / file_id).unlink()
                meta_path.unlink()
                fsync_dir(owner_dir)
                n += 1
        return n

    def begin(self, owner: str, limit: int) -> Upload:
        if self.count(owner) >= self.max_files:
            raise TooMany(self.max_files)
        return Upload(self, owner, limit)

    def record(
        self, owner: str, file_id: str, size: int, filename: str, purpose: str, **more: Any
    ) -> FileObject:
        """The metadata that makes the bytes at `file_id` a file (or, `state` other than READY, a
        journal entry that does not)."""
        meta = FileObject(file_id, size, int(self._clock()), filename, purpose, **more)
        self._write(owner, meta)
        return meta

    def _write(self, owner: str, meta: FileObject) -> None:
        write_atomic(self.dir_of(owner) / f"{meta.id}.json", json.dumps(asdict(meta)).encode())

    async def publish(
        self, owner: str, file_id: str, size: int, sha256: str, filename: str, purpose: str
    ) -> FileObject:
        """The durable bytes at `file_id` in the owner's directory made a file: described, or,
        with a bucket, journalled `uploading`, put, described as in the bucket, the local copy
        removed."""
        if self.objects is None:
            return await asyncio.to_thread(
                self.record, owner, file_id, size, filename, purpose, sha256=sha256
            )
        local = self.dir_of(owner) / file_id
        await asyncio.to_thread(
            self.record, owner, file_id, size, filename, purpose, sha256=sha256, state=UPLOADING
        )
        try:
            await self.objects.put(owner, file_id, local, size, sha256)
        except BaseException:  # not a file after all: the journal entry goes, the local bytes stay
            with contextlib.suppress(OSError):
                (self.dir_of(owner) / f"{file_id}.json").unlink()
            raise
        meta = await asyncio.to_thread(
            self.record, owner, file_id, size, filename, purpose, sha256=sha256, stored=S3
        )
        with contextlib.suppress(FileNotFoundError):
            local.unlink()
        return meta

    async def adopt(self, owner: str, file_id: str, path: Path, filename: str, purpose: str) -> FileObject:
        """A file a batch wrote (`path`, in its own directory) made one of the owner's files:
        renamed in, then published. Again after a crash in between, it does only what is left."""
        final = self.dir_of(owner) / file_id
        existing = self.get(owner, file_id)
        if existing is not None:
            return existing
        await asyncio.to_thread(_move_in, path, final)
        fd = open_regular(final)
        if fd is None:
            raise DiskError(f"{final} is missing: the batch's results were lost")
        with os.fdopen(fd, "rb") as f:
            size, sha256 = await asyncio.to_thread(hash_stream, f)
        return await self.publish(owner, file_id, size, sha256, filename, purpose)

    def _read(self, owner: str, file_id: str) -> FileObject | None:
        """The metadata at `file_id`, in whatever state."""
        if not FILE_ID.fullmatch(file_id):
            return None
        data = read_small(self.dir_of(owner) / f"{file_id}.json", META_BYTES)
        if data is None:
            return None
        try:
            return FileObject(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise DiskError(f"the metadata of {file_id} is damaged: {exc}") from None

    def holds(self, owner: str, file_id: str) -> bool:
        """Whether `file_id` is the owner's file, or its bytes are here waiting to be one."""
        return self.get(owner, file_id) is not None or (self.dir_of(owner) / file_id).is_file()

    def get(self, owner: str, file_id: str) -> FileObject | None:
        """The owner's file `file_id`, if it is one (not half uploaded or half deleted)."""
        found = self._read(owner, file_id)
        return found if found is not None and found.state == READY else None

    def list(self, owner: str) -> list[FileObject]:
        """The owner's files, oldest first."""
        out = []
        for path in self.dir_of(owner).glob("file-*.json"):
            found = self.get(owner, path.name[: -len(".json")])
            if found is not None:
                out.append(found)
        return sorted(out, key=lambda f: (f.created_at, f.id))

    def count(self, owner: str) -> int:
        return sum(1 for _ in self.dir_of(owner).glob("file-*.json"))

    async def open(self, owner: str, file_id: str, cache: Path) -> int | None:
        """The file's bytes on local disk, opened for reading (its descriptor), or None if it is
        not the owner's. A file in the bucket is fetched to `cache` first, once (a copy already
        there, of the right size, is used: it was checked when it was fetched)."""
        found = self.get(owner, file_id)
        if found is None:
            return None
        if found.stored != S3:
            return open_regular(self.dir_of(owner) / file_id)
        if self.objects is None:
            raise DiskError(f"{file_id} is in object storage, and no --files-store is configured")
        fd = open_regular(cache)
        if fd is not None and os.fstat(fd).st_size == found.bytes:
            return fd
        if fd is not None:
            os.close(fd)
        await self.objects.fetch(owner, file_id, cache, found.bytes, found.sha256)
        return open_regular(cache)

    async def read(self, owner: str, file_id: str) -> AsyncIterator[bytes] | None:
        """The file's bytes in chunks, from wherever they are; None if it is not the owner's."""
        found = self.get(owner, file_id)
        if found is None:
            return None
        if found.stored == S3:
            if self.objects is None:
                raise DiskError(f"{file_id} is in object storage, and no --files-store is configured")
            return await self.objects.stream(owner, file_id)
        fd = open_regular(self.dir_of(owner) / file_id)
        return None if fd is None else _read_chunks(fd)

    async def delete(self, owner: str, file_id: str) -> FileObject | None:
        """The file removed: gone from listings at once; its bytes after (a crash in between
        leaves it `deleting`, finished at the next start)."""
        found = self.get(owner, file_id)
        if found is None:
            return None
        directory = self.dir_of(owner)
        if found.stored == S3:
            if self.objects is None:  # before the journal entry, which would hide the file
                raise DiskError(f"{file_id} is in object storage, and no --files-store is configured")
            await asyncio.to_thread(self._write, owner, replace(found, state=DELETING))
            await self.objects.delete(owner, file_id)
        (directory / f"{file_id}.json").unlink()
        fsync_dir(directory)
        with contextlib.suppress(FileNotFoundError):
            (directory / file_id).unlink()
        return found


def _move_in(path: Path, final: Path) -> None:
    """`path` renamed to `final`, durably; nothing if it was moved already."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, final)
        fsync_dir(final.parent)


async def _read_chunks(fd: int) -> AsyncIterator[bytes]:
    with os.fdopen(fd, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, READ_CHUNK):
            yield chunk


class TooMany(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} files")
        self.limit = limit
