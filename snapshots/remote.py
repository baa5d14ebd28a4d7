"""Snapshots in object storage: pull one from `s3://bucket/prefix` into the store (the push is
`snapshots.push`'s, what both share `snapshots.transfer`'s; all three are imported from here).

Layout in the bucket: `prefix/manifest.json` plus every manifest file at `prefix/<path>`. The
manifest goes up last, so a prefix whose push died halfway holds no manifest and is not a snapshot
anyone can pull. Its bytes are the stored manifest's own, so the id survives the round trip.

A pull, start to visible:

    GET manifest.json        refuse unsafe paths and pickled weights before a byte is fetched
    already stored?          touch it, done (nothing downloaded)
    flock the snapshot       one pull per snapshot per machine; the loser finds it stored, done
    HEAD every file          size must match the manifest; the ETag pins the object version
    resume                   the journaled prefix of each file (same ETag) is re-hashed in order,
                             kept as far as its digests match; the file's digest goes on from there
    make room, preallocate   the store's budget may evict; disk full fails here, not halfway
    ranged GETs              part_size each, `concurrency` at once across all files, If-Match the
                             ETag, written in place with pwrite, fsynced
    hash, journal            each file's one sha256 follows its parts in order as they land (from
                             the page cache, on a worker thread: a second core while the event
                             loop receives); each part is journaled with the digest of the prefix
                             it ends
    verify                   every file's sha256 against the manifest; a mismatch names the file
    commit                   rename the pull dir onto <id>: all of it appears at once

An interrupted pull (an error, Ctrl-C, SIGKILL) leaves its pull dir and journal for the next pull
to resume; a local write error (disk full) removes them, since keeping them holds the very space
that ran out.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from snapshots.compile_cache import CompileCaches
from snapshots.compile_remote import pull_caches
from snapshots.errors import (
    CorruptSnapshot,
    RemoteError,
    RemoteNotFound,
    SnapshotError,
    StoreWriteError,
)
from snapshots.manifest import MANIFEST_NAME, FileEntry, Manifest
from snapshots.pulldir import Journal, Part, exclusive, hash_into, journal_path, lock_path
from snapshots.push import PushReport, push
from snapshots.s3 import S3, RemoteConfig, S3Uri, ShortBody, connect, error_code
from snapshots.store import SnapshotStore
from snapshots.transfer import (
    Meter,
    Progress,
    T,
    get_manifest,
    parts,
    read_manifest,
    refuse_pickles,
    run_all,
)

__all__ = ["PullReport", "PushReport", "RemoteConfig", "pull", "push", "read_manifest"]


# Body bytes gathered per pwritev: one thread hop per MiB, not per socket read, and the socket's
# chunks are written as they came (a vector write), never joined into one buffer first. Each read
# asks for at most what one socket read brings (asyncio's 256 KiB): asking for more makes aiohttp
# join its buffered chunks into a new bytes object, a copy of every byte (measured: 4 MiB writes,
# or 1 MiB reads, cost more CPU per pull than they save in thread hops).
WRITE_BYTES = 1024 * 1024
READ_BYTES = 256 * 1024
IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers per pwritev: 1024 on Linux; a MiB is a handful of reads


@dataclass(frozen=True)
class PullReport:
    id: str
    path: Path
    uri: str
    bytes_downloaded: int  # received over the network by this pull
    bytes_reused: int  # kept from an earlier, interrupted pull after re-hashing
    seconds: float
    shared: bool = False  # another pull of this snapshot finished it while this one waited
    compile_caches: int = 0  # compile caches downloaded with it (snapshots.compile_remote)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


async def pull(
    store: SnapshotStore,
    uri: str,
    config: RemoteConfig,
    progress: Progress | None = None,
    *,
    expected_id: str | None = None,
) -> PullReport:
    """Make the snapshot at `uri` local; return where it is and what it took.

    `expected_id`, if given, must be the snapshot's id (a deployment that read the manifest earlier
    gets exactly those bytes, or an error if the prefix was pushed over meanwhile).
    """
    started = time.monotonic()
    where = S3Uri.parse(uri)

    async def report(sid: str, downloaded: int = 0, reused: int = 0, shared: bool = False) -> PullReport:
        store.touch(sid)
        store.remember_remote(sid, str(where))
        # The snapshot's compile caches come along (a node's first start then does not compile),
        # also when the snapshot itself was here already: another node may have compiled since.
        caches = await pull_caches(s3, where, CompileCaches(store.root), sid)
        seconds = time.monotonic() - started
        return PullReport(
            sid, store.path_of(sid), str(where), downloaded, reused, seconds, shared, caches.pulled
        )

    async with connect(config) as s3:
        manifest, raw = await get_manifest(s3, where)
        sid = manifest.snapshot_id
        if expected_id is not None and sid != expected_id:
            raise CorruptSnapshot(
                f"the snapshot at {where} is {sid[:12]}, not the expected {expected_id[:12]}"
            )
        refuse_pickles(manifest, where)
        if store.path_of(sid).is_dir():
            return await report(sid)
        pull_dir = store.pull_dir(sid)
        try:
            store.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreWriteError(f"cannot create {store.root}: {exc.strerror or exc}") from exc
        async with exclusive(lock_path(pull_dir)):
            if store.path_of(sid).is_dir():  # a concurrent pull finished it while we waited
                return await report(sid, shared=True)
            job = _Pull(s3, where, manifest, raw, store, pull_dir, config, progress)
            try:
                await job.run()
            except OSError as exc:
                job.discard()
                where_ = f" ({exc.filename})" if exc.filename else ""
                raise StoreWriteError(
                    f"cannot write the snapshot into {store.root}: {exc.strerror or exc}{where_}; "
                    "the partial pull was removed"
                ) from exc
            except StoreWriteError:
                job.discard()
                raise
            return await report(sid, job.downloaded, job.reused)


@dataclass
class _File:
    entry: FileEntry
    etag: str = ""
    fd: int = -1
    # The whole-file sha256 follows the parts in order while the pull runs (from the page cache, just
    # written), so the check before the commit is not a pass over every byte at the end, and it is
    # the only hash a byte gets: nothing is hashed as it is received.
    digest: Any = field(default_factory=hashlib.sha256)
    hashed: int = 0  # bytes [0, hashed) are in `digest`
    done: dict[int, int] = field(default_factory=dict)  # offset -> length of parts written, unhashed
    hashing: asyncio.Lock = field(default_factory=asyncio.Lock)


class _Pull:
    """One pull into one pull dir, holding the snapshot's lock. See the module docstring."""

    def __init__(
        self,
        s3: S3,
        where: S3Uri,
        manifest: Manifest,
        raw: bytes,
        store: SnapshotStore,
        pull_dir: Path,
        config: RemoteConfig,
        progress: Progress | None,
    ) -> None:
        self.s3, self.where, self.manifest, self.raw = s3, where, manifest, raw
        self.store, self.dir, self.config, self.progress = store, pull_dir, config, progress
        self.journal = Journal(journal_path(pull_dir))
        self.sem = asyncio.Semaphore(config.concurrency)
        # Every blocking call of this pull runs here, so that on any exit, cancellation included,
        # all of them can be waited for before the files' descriptors are closed: a pwrite still
        # running on a closed (and perhaps reused) descriptor could write into another file.
        self.pool = ThreadPoolExecutor(config.concurrency + 2, thread_name_prefix="snapshot-pull")
        self.files = [_File(e) for e in manifest.files]
        self.kept: list[Part] = []
        self.downloaded = 0
        self.reused = 0

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.journal.remove()

    def _io(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def run(self) -> None:
        try:
            await self._io(self._prepare_dir)
            await run_all(self._head(f) for f in self.files if f.entry.size > 0)
            await self._io(self._reconcile)
            await self._io(self._allocate)
            meter = Meter(self.progress, self.manifest.total_bytes, self.reused)
            # A file that fails its sha256 does not stop the others: their parts stay for the next pull.
            corrupt = [bad for bad in await run_all(self._fetch_file(f, meter) for f in self.files) if bad]
            if corrupt:
                raise corrupt[0]
        finally:
            # Shielded and in a thread: waiting for the pool must neither block the loop nor be cut
            # short by a second cancellation.
            await asyncio.shield(asyncio.to_thread(self._close))
        await asyncio.to_thread(self.store.commit, self.dir)
        self.journal.remove()

    def _close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for f in self.files:
            if f.fd >= 0:
                os.close(f.fd)
                f.fd = -1

    def _prepare_dir(self) -> None:
        """The pull dir with this manifest in it: a dir left for another manifest is wiped."""
        manifest_path = self.dir / MANIFEST_NAME
        if self.dir.exists():
            try:
                ok = Manifest.from_json(manifest_path.read_bytes()).snapshot_id == self.manifest.snapshot_id
            except (OSError, SnapshotError):
                ok = False
            if not ok:
                self.discard()
        self.dir.mkdir(exist_ok=True)
        if not manifest_path.exists():
            with open(manifest_path, "wb") as f:
                f.write(self.raw)
                f.flush()
                os.fsync(f.fileno())

    async def _head(self, f: _File) -> None:
        url = self.where.url(f.entry.path)
        async with self.sem:
            try:
                head = await self.s3.head(self.where.bucket, self.where.key(f.entry.path), f"HEAD {url}")
            except RemoteNotFound as exc:
                raise RemoteNotFound(f"{url} is missing: the snapshot at {self.where} is incomplete") from exc
        if head.get("ContentLength") != f.entry.size:
            raise CorruptSnapshot(
                f"{f.entry.path}: {url} is {head.get('ContentLength')} bytes, the manifest says {f.entry.size}"
            )
        f.etag = head.get("ETag", "")

    def _reconcile(self) -> None:
        """Keep each file's journaled prefix that still holds: same object (ETag), same plan, same bytes.

        A record holds the sha256 of its file from byte 0 to its part's end, so the kept parts are
        re-hashed in order into the file's running digest, each checked as it ends: the first that
        no longer matches (an edited or lying disk) is dropped with all after it, and the digest is
        left where the last good part ends, for the pull to go on from. Those bytes are hashed once.
        """
        by_path = {f.entry.path: f for f in self.files}
        records = self.journal.load()
        journaled: dict[str, dict[int, Part]] = {}
        for part in records:
            f = by_path.get(part.path)
            if f is None or not f.etag or part.etag != f.etag:
                continue  # another object, or one pushed over since: its parts may differ
            journaled.setdefault(part.path, {}).setdefault(part.offset, part)
        kept: list[Part] = []
        for path, by_offset in journaled.items():
            kept += self._rehash_prefix(by_path[path], by_offset)
        if len(kept) != len(records):
            self.journal.replace(kept)
        self.kept = kept
        self.reused = sum(p.length for p in kept)

    def _rehash_prefix(self, f: _File, journaled: dict[int, Part]) -> list[Part]:
        """The journaled parts of `f` that continue its prefix from byte 0 and still hash to their record."""
        try:
            fd = os.open(self.dir / f.entry.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        kept: list[Part] = []
        try:
            for offset, length in parts(f.entry.size, self.config.part_size):
                part = journaled.get(offset)
                if part is None or part.length != length:
                    break  # not journaled (or planned at another part size): fetched from here on
                trial = f.digest.copy()  # a part that fails leaves the digest as it was
                if hash_into(trial, fd, offset, length) != length or trial.hexdigest() != part.prefix_sha256:
                    break
                f.digest, f.hashed = trial, offset + length
                kept.append(part)
        finally:
            os.close(fd)
        return kept

    def _allocate(self) -> None:
        """Open every file, sized in full up front: a full disk fails now, not after gigabytes."""
        present = 0
        for f in self.files:
            path = self.dir / f.entry.path
            if path.is_file() and path.stat().st_size == f.entry.size:
                present += f.entry.size
        self.store.make_room(self.manifest.total_bytes - present)
        for f in self.files:
            path = self.dir / f.entry.path
            path.parent.mkdir(parents=True, exist_ok=True)
            f.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(f.fd).st_size != f.entry.size:
                os.ftruncate(f.fd, f.entry.size)
            if f.entry.size:
                try:
                    os.posix_fallocate(f.fd, 0, f.entry.size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise  # ENOSPC, EFBIG, EDQUOT: the disk cannot hold it
                    # a filesystem without fallocate: blocks are taken as written instead

    async def _fetch_file(self, f: _File, meter: Meter) -> CorruptSnapshot | None:
        """Fetch what is missing of one file and check its sha256: the mismatch is returned, not raised."""
        done = {p.offset for p in self.kept if p.path == f.entry.path}  # hashed by `_reconcile`
        plan = parts(f.entry.size, self.config.part_size)
        try:
            await run_all(
                self._fetch_part(f, off, n, len(plan) > 1, meter) for off, n in plan if off not in done
            )
        except RemoteError as exc:
            if error_code(exc.__cause__)[0] in ("PreconditionFailed", "412"):
                self._drop(f)
                raise RemoteError(
                    f"{self.where.url(f.entry.path)} changed while it was being pulled; pull again"
                ) from exc
            raise
        if f.hashed != f.entry.size:  # cannot happen when the plan covers the file: check it anyway
            raise CorruptSnapshot(f"{f.entry.path}: {f.hashed} of {f.entry.size} bytes were pulled")
        if f.digest.hexdigest() != f.entry.sha256:
            await self._io(self._drop, f)
            return CorruptSnapshot(
                f"{f.entry.path}: sha256 of the bytes pulled from {self.where.url(f.entry.path)} does not "
                "match the manifest; refused (the bucket copy is altered or corrupt)"
            )
        return None

    async def _follow(self, f: _File) -> None:
        """Hash the parts on disk that continue the file's hashed prefix, in order, one follower at a
        time, journaling each with the digest of the prefix it ends.

        A record promises bytes on disk, so the file is fdatasynced before its records are
        appended; both run beside the next part's hash rather than before it, and the parts hashed
        meanwhile share the next sync and append. One sync covers every part written so far, so a
        file gets a few syncs rather than one per part (each also flushes the disk's cache: at
        8 MiB parts, one per part cost more than the hashing).
        """
        async with f.hashing:
            journaling: asyncio.Future[None] | None = None
            unjournaled: list[Part] = []
            while (length := f.done.pop(f.hashed, None)) is not None:
                part = await self._io(self._hash_part, f, f.hashed, length)
                if part is None:
                    break
                unjournaled.append(part)
                if journaling is None or journaling.done():
                    if journaling is not None:
                        await journaling  # its error, if any, is this pull's
                    journaling = self._io(self._sync_and_journal, f, unjournaled)
                    unjournaled = []
            if journaling is not None:
                await journaling
            if unjournaled:
                await self._io(self._sync_and_journal, f, unjournaled)

    def _sync_and_journal(self, f: _File, hashed: list[Part]) -> None:
        os.fdatasync(f.fd)
        self.journal.append(*hashed)

    def _hash_part(self, f: _File, offset: int, length: int) -> Part | None:
        """Feed one written part to the file's digest; return its journal record (None: file too short)."""
        got = hash_into(f.digest, f.fd, offset, length)
        f.hashed += got
        if got != length:
            return None  # the file is shorter than planned: the check after the fetch says so
        return Part(f.entry.path, offset, length, f.etag, f.digest.hexdigest())

    def _drop(self, f: _File) -> None:
        """Forget a file's parts, so the next pull fetches it afresh."""
        self.kept = self.journal.drop(f.entry.path)

    async def _fetch_part(self, f: _File, offset: int, length: int, ranged: bool, meter: Meter) -> None:
        url = self.where.url(f.entry.path)
        what = f"GET {url}" + (f" bytes {offset}-{offset + length - 1}" if ranged else "")
        params: dict[str, Any] = {"Bucket": self.where.bucket, "Key": self.where.key(f.entry.path)}
        if f.etag:
            params["IfMatch"] = f.etag  # every part from one object version, or a 412
        if ranged:
            params["Range"] = f"bytes={offset}-{offset + length - 1}"

        async def attempt() -> None:
            got = 0
            try:
                resp = await self.s3.client.get_object(**params)
                async with resp["Body"] as body:
                    if resp.get("ContentLength") != length:
                        raise RemoteError(
                            f"{what}: the store sent {resp.get('ContentLength')} bytes, not {length} "
                            "(does it support ranged GETs?)"
                        )
                    pending: list[bytes] = []
                    buffered = 0
                    while got + buffered < length:
                        chunk = await body.read(min(READ_BYTES, length - got - buffered))
                        if not chunk:
                            raise ShortBody(f"{what}: body ended after {got + buffered} of {length} bytes")
                        self.downloaded += len(chunk)
                        pending.append(chunk)
                        buffered += len(chunk)
                        if buffered >= WRITE_BYTES or got + buffered == length:
                            await self._io(_pwrite_all, f.fd, pending, offset + got)
                            got += buffered
                            meter.add(buffered)
                            pending, buffered = [], 0
            except BaseException:
                meter.add(-got)  # this attempt's bytes are fetched again
                raise

        async with self.sem:
            await self.s3.run(attempt, what)
        # Hashed, synced and journaled outside the semaphore: the next GET starts meanwhile.
        f.done[offset] = length
        await self._follow(f)


def _pwrite_all(fd: int, chunks: list[bytes], offset: int) -> None:
    """Write `chunks` one after another at `offset` (pwritev, which releases the GIL), all of them."""
    views = [memoryview(c) for c in chunks]
    while views:
        n = os.pwritev(fd, views[:IOV_MAX], offset)
        offset += n
        while views and n >= len(views[0]):  # drop what was written; a short write resumes mid-chunk
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
