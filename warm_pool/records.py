"""Crash-safe records of live instances, so the next run can stop what this one leaves behind.

One small JSON file per instance in a directory, written whole or not at all (temp file, fsync,
rename). On start-up the platform calls `reap_orphans`: every recorded process that still runs
(same PID and start time) is stopped; every record is removed. A record is written once the engine
is spawned, so a run killed between the two leaves an engine no record names: every engine also
carries its owner in its environment (`local.OWNER_ENV`, the data dir), and `reap_orphans` stops
any process that says it belongs to this data dir, recorded or not (`marked`).

We stop orphans rather than adopt them: an adopted engine runs with whatever flags and snapshot the
previous run gave it, which need not match the deployment as restored from the registry (a new
revision, other limits), and telling the two apart means trusting a process we did not start. A
clean start costs a few seconds of cold start once, after a crash; a wrong adoption costs until
someone notices.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from warm_pool.local import OWNER_ENV, ProcessHandle, read_start_ticks

log = logging.getLogger("warm_pool.records")
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class InstanceRecord:
    id: str
    deployment: str
    pid: int
    pgid: int
    start_ticks: int
    port: int
    url: str
    started_at: float  # wall-clock seconds (time.time()), for people reading the files

    @property
    def handle(self) -> ProcessHandle:
        return ProcessHandle(self.pid, self.pgid, self.start_ticks)


class InstanceRecords:
    def __init__(self, dir: Path) -> None:
        self.dir = dir

    def put(self, record: InstanceRecord) -> None:
        path = self._path(record.id)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        data = json.dumps(asdict(record), sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(self.dir, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def remove(self, instance_id: str) -> None:
        self._path(instance_id).unlink(missing_ok=True)

    def all(self) -> list[InstanceRecord]:
        """Every readable record, by id. A file that does not parse is logged and skipped."""
        if not self.dir.is_dir():
            return []
        records = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                records.append(InstanceRecord(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping unreadable instance record %s: %s", path, exc)
        return records

    def _path(self, instance_id: str) -> Path:
        if not _SAFE_ID.match(instance_id):
            raise ValueError(f"instance id must be letters, digits, '_', '.', '-', got {instance_id!r}")
        return self.dir / f"{instance_id}.json"


class ProcessStopper(Protocol):
    """What `reap_orphans` needs from a backend (`LocalBackend` is one)."""

    def is_alive(self, handle: ProcessHandle) -> bool: ...

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None: ...


def marked(owner: str, proc: Path = Path("/proc")) -> list[ProcessHandle]:
    """Every process whose environment says `OWNER_ENV=owner`, but this one: one handle per
    process group (stopping a group stops all of it). Processes of other users cannot be read,
    and are none of ours."""
    needle = f"{OWNER_ENV}={owner}".encode()
    me, groups = os.getpid(), {}
    for entry in proc.glob("[0-9]*"):
        pid = int(entry.name)
        if pid == me:
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            pgid = os.getpgid(pid)
        except OSError:  # gone, or not ours to read
            continue
        ticks = read_start_ticks(pid)
        if ticks is not None and pgid not in groups:
            leader = read_start_ticks(pgid) if pgid != pid else ticks
            groups[pgid] = (
                ProcessHandle(pgid, pgid, leader) if leader is not None else ProcessHandle(pid, pgid, ticks)
            )
    return list(groups.values())


async def reap_orphans(
    records: InstanceRecords,
    backend: ProcessStopper,
    *,
    owner: str | None = None,
    term_timeout_s: float = 10.0,
) -> list[str]:
    """Stop every recorded process still running (SIGTERM, SIGKILL after `term_timeout_s`), drop
    every record, then stop every process still marked as `owner`'s (an engine spawned but never
    recorded); the ids of the recorded processes stopped, and `pid:N` for each unrecorded one."""
    stopped: list[str] = []

    async def reap(record: InstanceRecord) -> None:
        if backend.is_alive(record.handle):
            log.info("stopping instance %s (pid %d) left by a previous run", record.id, record.pid)
            await backend.stop(record.handle, term_timeout_s)
            stopped.append(record.id)
        records.remove(record.id)

    async def reap_unrecorded(handle: ProcessHandle) -> None:
        log.info("stopping process %d left by a previous run, which never recorded it", handle.pid)
        await backend.stop(handle, term_timeout_s)
        stopped.append(f"pid:{handle.pid}")

    async with asyncio.TaskGroup() as tg:
        for record in records.all():
            tg.create_task(reap(record))
    if owner is not None:
        async with asyncio.TaskGroup() as tg:
            for handle in marked(owner):
                if backend.is_alive(handle):
                    tg.create_task(reap_unrecorded(handle))
    return sorted(stopped)
