"""What a push and a pull share: progress metering, running parts all at once (failing as one),
cutting a file into parts, and reading a snapshot's manifest from object storage (refusing
pickled weights before a byte of them is fetched)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from snapshots.errors import (
    RemoteError,
    RemoteNotFound,
    UnsafeFileError,
)
from snapshots.manifest import MANIFEST_NAME, Manifest
from snapshots.s3 import S3, RemoteConfig, S3Uri, connect, error_code
from snapshots.weights import PICKLE_SUFFIXES, is_pickle

T = TypeVar("T")
Progress = Callable[[int, int], None]  # (bytes done, bytes in all), called as bytes move
MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # thousands of files fit in a few hundred kB


class Meter:
    """Bytes done out of a total, reported to an optional progress callback."""

    def __init__(self, progress: Progress | None, total: int, done: int = 0) -> None:
        self.progress, self.total, self.done = progress, total, done
        self._report()

    def add(self, n: int) -> None:
        self.done += n
        self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)


async def run_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Run all at once; on the first failure cancel the rest, wait for them, and raise that failure.

    Unlike a TaskGroup this raises the error itself, not an ExceptionGroup, so one-line errors stay
    one line; unlike gather it does not leave siblings running after a failure.
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # on a failure, or on our own cancellation: no task outlives this call
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    # Asking every task for its exception marks it retrieved: two that failed together must not
    # leave "Task exception was never retrieved" on stderr after our one-line error.
    errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        raise errors[0]
    return [t.result() for t in tasks]


def parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each part: 10 MiB at 4 MiB parts -> (0, 4M), (4M, 4M), (8M, 2M)."""
    return [(offset, min(part_size, size - offset)) for offset in range(0, size, part_size)]


async def get_manifest(s3: S3, where: S3Uri) -> tuple[Manifest, bytes]:
    url = where.url(MANIFEST_NAME)

    async def get() -> bytes:
        resp = await s3.client.get_object(Bucket=where.bucket, Key=where.key(MANIFEST_NAME))
        async with resp["Body"] as body:
            if resp.get("ContentLength", 0) > MAX_MANIFEST_BYTES:
                raise RemoteError(f"{url} is {resp['ContentLength']} bytes: too large to be a manifest")
            return await body.read()

    try:
        raw = await s3.run(get, f"GET {url}")
    except RemoteNotFound as exc:
        if error_code(exc.__cause__)[0] == "NoSuchBucket":
            raise
        raise RemoteNotFound(f"no snapshot at {where} (no {MANIFEST_NAME} there)") from exc
    return Manifest.from_json(raw), raw


async def read_manifest(uri: str, config: RemoteConfig) -> Manifest:
    """The manifest of the snapshot at `uri` (one GET): its id is `.snapshot_id`."""
    where = S3Uri.parse(uri)
    async with connect(config) as s3:
        manifest, _ = await get_manifest(s3, where)
    return manifest


def refuse_pickles(manifest: Manifest, where: S3Uri) -> None:
    for entry in manifest.files:
        if is_pickle(entry.path):
            kinds = "/".join(sorted(PICKLE_SUFFIXES))
            raise UnsafeFileError(
                f"refusing {where}: {entry.path} is pickled weights ({kinds}), never loaded since "
                "unpickling runs code"
            )


# --- pull ------------------------------------------------------------------------------------------
