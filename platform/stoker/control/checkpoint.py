"""Checkpoints: what the control plane learned while it ran, kept so that a restart carries on.

    $STOKER_HOME/checkpoints/cost.json       the cost meter's totals and last 24 h (`stoker.control.cost`)
    $STOKER_HOME/checkpoints/history.json    the dashboard's last hour (`stoker.control.history`)
    $STOKER_HOME/checkpoints/policies.json   each pool's policy state (`stoker.control.policy_states`)

Each source (`Checkpointed`) turns what it holds into a JSON body and back; a `CheckpointStore`
keeps the bodies by kind. `Checkpoints` restores every kind once at start (before the first pool
exists), writes every `interval_s` (`stoker up --checkpoint-interval`, 30 s) and once more at a
clean shutdown, after the pools have drained, so the last seconds count.

The file store (`FileCheckpointStore`) writes one file per kind, each

    {"format": 1, "kind": "cost", "written_at": 1764568800.125, "body": {...}}

atomically (a hidden temp file beside it, written, fsynced, renamed over the old one, the
directory fsynced: a crash mid-write leaves the old checkpoint whole), mode 0600 in a 0700
directory, never through a link (the file is opened with `O_NOFOLLOW`, a linked directory is
refused). Bounded: a checkpoint over `MAX_BYTES` (16 MiB, each file) is neither written (the old
one stays, and the log says so once) nor read. Measured at the defaults: a revision busy every
minute of the day takes ~280 KiB of cost, a deployment's hour of history (a point every 5 s)
~260 KiB, a predictive pool's state with every slot and bin filled ~45 KiB; so the bound holds the
cost of some 55 revisions that busy (idle ones take far less), the history of some 60 deployments
and the states of some 350 pools.

Reading is for hostile input: JSON only (no pickle, NaN and Infinity refused), every field of the
envelope and of the body checked by its source. A checkpoint that is missing is a first start; one
that is corrupt, truncated, over the bound, of another format or kind, or a link is refused with
one warning naming the file and why, and that source starts clean (a source restores all or
nothing: `restore` raises `ValueError` before it changes anything). It is replaced at the next write.

A cluster's controller has no volume: it keeps the same bytes, gzipped, in a ConfigMap per kind
(`stoker.control.kube.checkpoints.ConfigMapCheckpointStore`); both stores share `encode` and
`decode`, the sources are unchanged. Checkpoints hold names and figures, never a key, a prompt or
an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("stoker.checkpoint")

FORMAT = 1  # the envelope's and every body's layout; another is refused
MAX_BYTES = 16 << 20
DIR = "checkpoints"
MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 3600.0
_ENVELOPE = ("format", "kind", "written_at", "body")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")  # names and label values a body holds


class CheckpointRefused(Exception):
    """A checkpoint not read or not written; the message says why."""


class CheckpointStore(Protocol):
    """Where checkpoints are kept, by kind: files in the data dir (`FileCheckpointStore`), or on a
    cluster ConfigMaps (`stoker.control.kube.checkpoints`). Its calls block: `Checkpoints` makes them
    in threads."""

    def where(self, kind: str) -> str:
        """The checkpoint of `kind` as the log names it (a path, a ConfigMap)."""
        ...

    def read(self, kind: str) -> dict[str, Any] | None:
        """The body last written for `kind`; None if there is none. CheckpointRefused if there is
        one that cannot be trusted."""
        ...

    def write(self, kind: str, body: dict[str, Any]) -> None:
        """Replace the checkpoint of `kind` with `body` (JSON data), whole or not at all.
        CheckpointRefused if it cannot be (too large, the disk full, changed by another writer)."""
        ...


class Checkpointed(Protocol):
    """What a source of checkpoints offers: the cost meter, the history, the pools' policy states."""

    checkpoint_kind: str

    def checkpoint(self) -> dict[str, Any]:
        """What it holds now, as JSON data that no later change of its own alters."""
        ...

    def restore(self, body: dict[str, Any]) -> None:
        """Take back what `checkpoint` gave; ValueError naming the bad field, with nothing taken."""
        ...


def interval_error(seconds: float) -> str | None:
    """Why `seconds` cannot be the checkpoint interval (None: it can)."""
    if not (math.isfinite(seconds) and MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S):
        return f"must be {MIN_INTERVAL_S:g}s to {MAX_INTERVAL_S:g}s (or off), got {seconds:g}s"
    return None


class FileCheckpointStore:
    """One JSON file per kind in `dir` (see the module)."""

    def __init__(
        self, dir: Path, *, max_bytes: int = MAX_BYTES, wall: Callable[[], float] = time.time
    ) -> None:
        self.dir = dir
        self.max_bytes = max_bytes
        self._wall = wall
        self._swept: set[str] = set()

    def path(self, kind: str) -> Path:
        if not kind.isidentifier():
            raise ValueError(f"a checkpoint kind is a plain name, got {kind!r}")
        return self.dir / f"{kind}.json"

    def where(self, kind: str) -> str:
        return str(self.path(kind))

    # ---- reading --------------------------------------------------------------------------------

    def read(self, kind: str) -> dict[str, Any] | None:
        path = self.path(kind)
        if self.dir.is_symlink():
            raise CheckpointRefused(f"its directory {self.dir} is a symbolic link (links are not followed)")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointRefused("it is a symbolic link (links are not followed)") from None
            raise CheckpointRefused(f"cannot open it: {exc.strerror or exc}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointRefused("not a regular file")
            if st.st_size > self.max_bytes:
                raise CheckpointRefused(f"{st.st_size} bytes, over the bound of {self.max_bytes}")
            try:
                data = f.read(self.max_bytes + 1)
            except OSError as exc:
                raise CheckpointRefused(f"cannot read it: {exc.strerror or exc}") from None
        if len(data) > self.max_bytes:  # it grew between the stat and the read
            raise CheckpointRefused(f"over the bound of {self.max_bytes} bytes")
        return decode(data, kind)

    # ---- writing --------------------------------------------------------------------------------

    def write(self, kind: str, body: dict[str, Any]) -> None:
        path = self.path(kind)
        data = encode(kind, body, self._wall())
        if len(data) > self.max_bytes:
            raise CheckpointRefused(
                f"{len(data)} bytes, over the bound of {self.max_bytes}: not written (the previous one stays)"
            )
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.dir.is_symlink():  # O_NOFOLLOW guards the file's name, not its directory's
                raise CheckpointRefused(
                    f"its directory {self.dir} is a symbolic link (links are not followed)"
                )
            self._sweep(kind)
            tmp = self.dir / f".{kind}.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(self.dir)
        except OSError as exc:
            raise CheckpointRefused(f"cannot write it: {exc.strerror or exc}") from None

    def _sweep(self, kind: str) -> None:
        """Once a process: the temp files a run that died mid-write left (their names are hidden)."""
        if kind in self._swept:
            return
        self._swept.add(kind)
        for left in self.dir.glob(f".{kind}.json.tmp-*"):
            with contextlib.suppress(OSError):
                left.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON has")


def encode(kind: str, body: dict[str, Any], written_at: float) -> bytes:
    """A checkpoint's bytes, as every store keeps them: the envelope (see the module) around `body`,
    compact JSON. CheckpointRefused if `body` is not JSON data (a source's bug)."""
    envelope = {"format": FORMAT, "kind": kind, "written_at": round(written_at, 3), "body": body}
    try:
        return json.dumps(envelope, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointRefused(f"its body is not JSON data: {exc}") from None


def decode(data: bytes, kind: str) -> dict[str, Any]:
    """The body of a checkpoint's bytes (what `encode` made), its envelope checked; CheckpointRefused
    otherwise. The caller bounds `data` first."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointRefused("not JSON (truncated or corrupt)") from None
    if not isinstance(doc, dict) or set(doc) != set(_ENVELOPE):
        raise CheckpointRefused(f"not a checkpoint (want an object of {', '.join(_ENVELOPE)})")
    version = doc["format"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise CheckpointRefused(f"bad format {version!r:.40}")
    if version != FORMAT:
        raise CheckpointRefused(f"format {version}, and this version reads format {FORMAT}")
    if doc["kind"] != kind:
        raise CheckpointRefused(f"a checkpoint of {doc['kind']!r:.40}, not of {kind!r}")
    written = doc["written_at"]
    if isinstance(written, bool) or not isinstance(written, int | float) or not math.isfinite(written):
        raise CheckpointRefused(f"bad written_at {written!r:.40}")
    if not isinstance(doc["body"], dict):
        raise CheckpointRefused("its body is not an object")
    return doc["body"]


# ---- reading a body: each reader raises ValueError naming the field -----------------------------------


def fields(value: object, where: str, keys: Sequence[str]) -> dict[str, Any]:
    """An object with exactly `keys`."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: want an object, got {_kind(value)}")
    if set(value) != set(keys):
        extra, missing = sorted(set(value) - set(keys)), sorted(set(keys) - set(value))
        raise ValueError(f"{where}: want the fields {', '.join(keys)} (missing {missing}, unknown {extra})")
    return value


def items(value: object, where: str, most: int, length: int | None = None) -> list[Any]:
    """A list of at most `most` items (exactly `length`, if given)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: want a list, got {_kind(value)}")
    if len(value) > most:
        raise ValueError(f"{where}: {len(value)} items, more than {most}")
    if length is not None and len(value) != length:
        raise ValueError(f"{where}: want {length} items, got {len(value)}")
    return value


def number(value: object, where: str, *, low: float | None = 0.0, optional: bool = False) -> float | None:
    """A finite number, at least `low` (None: any); None too if `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: want a finite number, got {value!r:.40}")
    if low is not None and value < low:
        raise ValueError(f"{where}: want a number ≥ {low:g}, got {value!r}")
    return float(value)


def count(value: object, where: str, *, low: int = 0) -> int:
    """A whole number, at least `low`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: want a whole number ≥ {low}, got {value!r:.40}")
    return value


def label(value: object, where: str, pattern: re.Pattern[str] = LABEL) -> str:
    """A name or label value (a deployment, a state, a tier) that `pattern` matches."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{where}: bad name {value!r:.80}")
    return value


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


class Checkpoints:
    """Restore at start, write every `interval_s` and at a clean shutdown (see the module)."""

    def __init__(self, store: CheckpointStore, sources: Sequence[Checkpointed], interval_s: float) -> None:
        if (why := interval_error(interval_s)) is not None:
            raise ValueError(f"checkpoint interval {why}")
        self.store = store
        self.sources = tuple(sources)
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._failing: set[str] = set()  # kinds whose last write failed (logged once)

    async def restore(self) -> None:
        """Each source from its checkpoint, or clean: a refused one is one warning, never a crash.
        Read off the loop (a store may be the API server's, over HTTP), taken back on it."""
        for source in self.sources:
            kind = source.checkpoint_kind
            try:
                body = await asyncio.to_thread(self.store.read, kind)
                if body is None:
                    continue
                source.restore(body)
            except (CheckpointRefused, ValueError) as exc:
                log.warning("checkpoint %s refused: %s; %s starts clean", self.store.where(kind), exc, kind)
            except Exception:  # a bug of ours must not keep the platform from starting
                log.exception("checkpoint %s not restored; %s starts clean", self.store.where(kind), kind)
            else:
                log.info("restored %s from %s", kind, self.store.where(kind))

    async def write(self) -> None:
        """Every source's checkpoint: gathered here (on the loop), written off it."""
        for source in self.sources:
            kind = source.checkpoint_kind
            try:
                body = source.checkpoint()
                await asyncio.to_thread(self.store.write, kind, body)
            except CheckpointRefused as exc:
                if kind not in self._failing:
                    log.warning("checkpoint %s not written: %s", self.store.where(kind), exc)
                self._failing.add(kind)
            except Exception:
                if kind not in self._failing:
                    log.exception("checkpoint %s not written", self.store.where(kind))
                self._failing.add(kind)
            else:
                if kind in self._failing:
                    log.info("checkpoint %s written again", self.store.where(kind))
                self._failing.discard(kind)

    def start(self) -> None:
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="stoker-checkpoints")

    async def _run(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
                return
            await self.write()

    async def stop(self) -> None:
        """Stop the periodic writes, letting one under way finish (a write cut off in its thread
        could land after the shutdown's, which is the caller's, once it has drained)."""
        if self._task is not None:
            self._stopping.set()
            await self._task
            self._task = None
