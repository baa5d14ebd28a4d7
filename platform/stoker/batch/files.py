"""A tenant's files (`/v1/files`): uploaded batch inputs and the batches' output and error files.

    <data dir>/files/<tenant>/file-<24 hex>        the bytes, as uploaded (or as a batch wrote them)
    <data dir>/files/<tenant>/file-<24 hex>.json   its File object: filename, purpose, bytes, created_at

A file exists once its metadata does: an upload is streamed into a hidden temp file (0600, created
with `O_EXCL | O_NOFOLLOW`), fsynced, renamed to its name, and then its metadata is written
atomically (`stoker.batch.disk`); a delete removes the metadata first. So a listing never shows a
half-written file, and a crash leaves at most a temp file (swept at the next start) or bytes
without metadata (swept too, unless an unfinished batch is about to adopt them).

Each tenant has a directory of its own and sees only it: the admin's is `_admin`, which no tenant
name can be (tenant names start with a letter or digit, `stoker.spec.keys.TENANT`). Ids are checked
against their pattern before any path is made of them. The number of files a tenant keeps is
bounded (`BatchConfig.max_files`), and each upload's size (`upload_limit_bytes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
ADMIN_OWNER = "_admin"
UPLOAD_PURPOSES = ("batch",)  # what `POST /v1/files` takes; "batch_output" is the batches' own
MAX_FILENAME = 255
META_BYTES = 4096


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

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise OverLimit(self.limit)
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view) :]

    def commit(self, filename: str, purpose: str) -> FileObject:
        """The bytes made durable under their name, then the metadata that makes them a file."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.path, self.final)
        fsync_dir(self.final.parent)
        return self.store.record(self.owner, self.id, self.size, filename, purpose)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            self.path.unlink()


class OverLimit(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"over {limit} bytes")
        self.limit = limit


class FileStore:
    def __init__(self, root: Path, max_files: int, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.max_files = max_files
        self._clock = clock

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

    def begin(self, owner: str, limit: int) -> Upload:
        if self.count(owner) >= self.max_files:
            raise TooMany(self.max_files)
        return Upload(self, owner, limit)

    def record(self, owner: str, file_id: str, size: int, filename: str, purpose: str) -> FileObject:
        """The metadata that makes the bytes at `file_id` a file."""
        meta = FileObject(file_id, size, int(self._clock()), filename, purpose)
        write_atomic(self.dir_of(owner) / f"{file_id}.json", json.dumps(asdict(meta)).encode())
        return meta

    def adopt(self, owner: str, file_id: str, path: Path, filename: str, purpose: str) -> FileObject:
        """A file a batch wrote (`path`, in its own directory) made one of the owner's files:
        renamed in, then described. Again after a crash between the two, it only describes."""
        final = self.dir_of(owner) / file_id
        existing = self.get(owner, file_id)
        if existing is not None:
            return existing
        if path.exists():
            os.replace(path, final)
            fsync_dir(final.parent)
        fd = open_regular(final)
        if fd is None:
            raise DiskError(f"{final} is missing: the batch's results were lost")
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return self.record(owner, file_id, size, filename, purpose)

    def get(self, owner: str, file_id: str) -> FileObject | None:
        if not FILE_ID.fullmatch(file_id):
            return None
        data = read_small(self.dir_of(owner) / f"{file_id}.json", META_BYTES)
        if data is None:
            return None
        try:
            return FileObject(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise DiskError(f"the metadata of {file_id} is damaged: {exc}") from None

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

    def open(self, owner: str, file_id: str) -> int | None:
        """The file's bytes, opened for reading (its descriptor), or None if it is not the owner's."""
        if self.get(owner, file_id) is None:
            return None
        return open_regular(self.dir_of(owner) / file_id)

    def delete(self, owner: str, file_id: str) -> FileObject | None:
        found = self.get(owner, file_id)
        if found is None:
            return None
        directory = self.dir_of(owner)
        (directory / f"{file_id}.json").unlink()
        fsync_dir(directory)
        with contextlib.suppress(FileNotFoundError):
            (directory / file_id).unlink()
        return found


class TooMany(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} files")
        self.limit = limit
