"""Crash-safe records of live local instances, so that a restarted controller adopts them.

One small JSON file per instance in a directory only its owner may enter, written whole or not at
all (temp file, fsync, rename), readable by its owner only: it holds the instance's key, which the
next run needs to reach the engine. A record is written once the engine is spawned and removed
once it is stopped; `LocalBackend.running` reads them back. Every engine also carries its owner
in its environment (`procs.OWNER_ENV`, the data dir), so an engine spawned by a run that died
before recording it is found (`marked`) and stopped: without its key it cannot be adopted.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from warm_pool.backends.base import Placement
from warm_pool.backends.procs import OWNER_ENV, ProcessHandle, read_start_ticks

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
    started_at: float  # wall-clock seconds (time.time())
    snapshot_id: str = ""
    secret: str = field(default="", repr=False)  # the engine's key; "" in records from before keys

    @property
    def handle(self) -> ProcessHandle:
        return ProcessHandle(self.pid, self.pgid, self.start_ticks, self.id)

    @classmethod
    def of(cls, placement: Placement, handle: ProcessHandle, url: str, started_at: float) -> InstanceRecord:
        return cls(
            placement.instance_id,
            placement.deployment,
            handle.pid,
            handle.pgid,
            handle.start_ticks,
            placement.port,
            url,
            started_at,
            placement.snapshot_id,
            placement.secret,
        )


class InstanceRecords:
    def __init__(self, dir: Path) -> None:
        self.dir = dir

    def put(self, record: InstanceRecord) -> None:
        path = self._path(record.id)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)  # a directory made by an older version was world-readable
        tmp = path.with_name(f".{path.name}.tmp")
        data = json.dumps(asdict(record), sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
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
