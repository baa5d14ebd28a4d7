"""The tenants' files in object storage, where `stoker up --files-store s3://bucket/prefix` names one.

    s3://bucket/prefix/<tenant>/file-<24 hex>     the bytes (object metadata `sha256`)

The File objects (the metadata) stay in the data dir (`stoker.batch.files`): they are the index a
listing reads, and the journal of what is in the bucket. An upload or a batch's result file is made
durable on local disk first, then put (one PUT, or parallel parts over the part size, as snapshots
are pushed: `snapshots.push.put_file`), and only then does its metadata say the bytes are in the
bucket and the local copy go. A batch reads its input from a local copy it fetches once into its
work dir, checked against the size and sha256 recorded at upload (a changed or damaged object fails
the batch, not a line of it); `GET /v1/files/{id}/content` streams the object.

Everything goes through `snapshots.s3`'s client: the same retries (throttling, 5xx, a body cut
short) and the same one-line errors, credentials from the standard AWS chain (nothing here reads
or logs a key), the endpoint from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` for S3-compatible
stores. Keys are made only of a checked tenant name and a checked file id. One prefix belongs to
one platform's data dir: the metadata that says what is there is that data dir's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from snapshots.errors import RemoteError, RemoteNotFound
from snapshots.manifest import FileEntry
from snapshots.push import put_file
from snapshots.s3 import S3, RemoteConfig, S3Uri, connect
from stoker.batch.disk import DiskError, create_new, fsync_dir, temp_beside

READ_CHUNK = 1 << 20


class FileObjects:
    """The bucket and prefix the files' bytes live under, and one client for the app's lifetime."""

    def __init__(self, uri: str, config: RemoteConfig) -> None:
        self.where = S3Uri.parse(uri)
        self.config = config
        self._stack: contextlib.AsyncExitStack | None = None
        self._s3: S3 | None = None
        self._lock = asyncio.Lock()
        self._sem = asyncio.Semaphore(config.concurrency)

    def __str__(self) -> str:
        return str(self.where)

    async def _client(self) -> S3:
        async with self._lock:
            if self._s3 is None:
                stack = contextlib.AsyncExitStack()
                self._s3 = await stack.enter_async_context(connect(self.config))
                self._stack = stack
            return self._s3

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._stack = self._s3 = None

    @staticmethod
    def rel(owner: str, file_id: str) -> str:
        return f"{owner}/{file_id}"

    def url(self, owner: str, file_id: str) -> str:
        return self.where.url(self.rel(owner, file_id))

    async def put(self, owner: str, file_id: str, path: Path, size: int, sha256: str) -> None:
        """The local file `path` (already durable) put as the owner's `file_id`."""
        s3 = await self._client()
        entry = FileEntry(self.rel(owner, file_id), size, sha256)
        await put_file(s3, self.where, entry, path, self.config, self._sem)

    async def stream(self, owner: str, file_id: str) -> AsyncIterator[bytes]:
        """The object's bytes, in chunks (a GET that fails before its first byte raises)."""
        s3 = await self._client()
        what = f"GET {self.url(owner, file_id)}"
        answer = await s3.call(
            "get_object", what, Bucket=self.where.bucket, Key=self.where.key(self.rel(owner, file_id))
        )
        return _chunks(answer["Body"])

    async def fetch(self, owner: str, file_id: str, dest: Path, size: int, sha256: str | None) -> None:
        """The object copied to `dest` (0600, never through a link), checked against `size` and
        `sha256` before it is renamed there; each attempt starts over."""
        s3 = await self._client()
        key = self.where.key(self.rel(owner, file_id))
        url = self.url(owner, file_id)
        tmp = temp_beside(dest)

        async def attempt() -> None:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = create_new(tmp)
            digest, got = hashlib.sha256(), 0
            try:
                answer = await s3.client.get_object(Bucket=self.where.bucket, Key=key)
                async for chunk in _chunks(answer["Body"]):
                    got += len(chunk)
                    if got > size:
                        break
                    digest.update(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if got != size or (sha256 is not None and digest.hexdigest() != sha256):
                raise RemoteError(f"{url} is not the file that was stored (its size or sha256 differs)")

        try:
            await s3.run(attempt, f"GET {url}")
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        except OSError as exc:
            raise DiskError(f"cannot write {dest}: {exc.strerror or exc}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    async def delete(self, owner: str, file_id: str) -> None:
        """The object removed (one that is not there already counts as removed)."""
        s3 = await self._client()
        with contextlib.suppress(RemoteNotFound):
            await s3.call(
                "delete_object",
                f"DELETE {self.url(owner, file_id)}",
                Bucket=self.where.bucket,
                Key=self.where.key(self.rel(owner, file_id)),
            )


async def _chunks(body) -> AsyncIterator[bytes]:
    try:
        while chunk := await body.read(READ_CHUNK):
            yield chunk
    finally:
        body.close()
