"""The local backend: engine processes on this machine, each in its own process group.

A process is named by `ProcessHandle(pid, pgid, start_ticks)`: `start_ticks` is the kernel's start
time of the process (`/proc/<pid>/stat`, field 22), so a handle read back after a restart is not
mistaken for an unrelated process that got the same PID later. Stopping signals the whole group,
so whatever the engine spawned goes with it.

Every engine it starts is recorded (`warm_pool.backends.records`: id, deployment, snapshot, process, address
and key, in a file only its owner may read) until it is stopped, and carries its owner (the data
dir) in its environment. A restarted controller's `running()` reads the records back: a recorded
process that still runs (same PID, same start time) is handed over for adoption, with the key that
reaches it; a dead one's record is dropped; an engine that says it is ours but was never recorded
(the run died between spawning and recording it) cannot be reached and is stopped.

With a `RuntimeKeeper` (`warm_pool.runtimes`), a start first asks it for a warm runtime that can run
the launch: one is handed the launch and becomes the engine (its PID, its process group; the handle
says `from_runtime`), and only without one is a fresh process spawned. The keeper starts keeping
runtimes at `running()` (the platform's first call, once the previous run's processes are sorted
out) and stops them at `aclose()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from warm_pool.backends.base import Placement, Running
from warm_pool.backends.procs import OWNER_ENV, ProcessHandle, killpg, read_start_ticks
from warm_pool.backends.records import InstanceRecord, InstanceRecords, marked
from warm_pool.engine_tls import EngineTls, connector, scheme
from warm_pool.errors import StartFailed
from warm_pool.handoff import HandoffError
from warm_pool.launch import LaunchSpec
from warm_pool.log_text import FAILURE_LOG_LINES, meaningful_lines
from warm_pool.runtimes import RuntimeKeeper
from warm_pool.snapshot import Acquired, SnapshotSource

log = logging.getLogger("warm_pool.local")
_LOG_TAIL_LINES = 5
_LOG_TAIL_BYTES = 64 * 1024  # a crash's traceback plus what follows it


@dataclass
class _Child:
    process: asyncio.subprocess.Process
    log_path: Path
    url: str


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS calls free now. Another process may take it before the engine binds it; the
    engine then exits at once and the start fails like any other."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _read_tail(path: Path, nbytes: int) -> str | None:
    """The last `nbytes` of a file as text; None if it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def log_tail_lines(path: Path, lines: int = _LOG_TAIL_LINES) -> list[str]:
    """The last meaningful lines of a log (at most `lines`, each at most 300 characters). The last
    line that names an error leads, if the tail itself does not hold it."""
    text = _read_tail(path, _LOG_TAIL_BYTES)
    return [] if text is None else meaningful_lines(text, lines)


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """`log_tail_lines` joined by " | ", to keep a message on one line."""
    return " | ".join(log_tail_lines(path, lines))


class LocalBackend:
    kind = "local"

    def __init__(
        self,
        log_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        owner: str | None = None,
        records: InstanceRecords | None = None,
        runtimes: RuntimeKeeper | None = None,
        engine_tls: EngineTls | None = None,
    ) -> None:
        """`engine_tls`: the engines serve HTTPS with its files (the pool adds them to each launch)
        and are verified with its context. `owner`, when given, goes into every engine's environment as `OWNER_ENV`, so a later run
        finds the engines of this one even where no record was written. Without `records` nothing
        is recorded and `running()` finds nothing (tests, benchmarks)."""
        self.log_dir = log_dir
        self._clock = clock
        self._owner_name = owner
        self._owner = {OWNER_ENV: owner} if owner else {}
        self._records = records
        self.engine_tls = engine_tls
        self.runtimes = runtimes  # warm runtimes a start takes first (`warm_pool.runtimes`), if any
        self._children: dict[ProcessHandle, _Child] = {}  # processes this backend started and has not reaped
        self._urls: dict[ProcessHandle, str] = {}  # where each engine it started or adopted answers

    def log_path(self, instance_id: str) -> Path:
        return self.log_dir / f"{instance_id}.log"

    def engine_port(self, host: str) -> int:
        return free_port(host)

    async def acquire(self, snapshot: SnapshotSource, holder: str) -> Acquired:
        return await snapshot.acquire(holder=holder)

    async def start(self, placement: Placement, spec: LaunchSpec) -> ProcessHandle:
        """Spawn `spec` in a new session (its own process group), output appended to its log, and
        record it."""
        instance_id = placement.instance_id
        if not instance_id or "/" in instance_id or instance_id.startswith("."):
            raise ValueError(f"instance id must be a plain file name, got {instance_id!r}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path(instance_id)
        handle, process = await self._from_runtime(spec, log_path, instance_id)
        if process is None:
            with log_path.open("ab") as out:
                process = await asyncio.create_subprocess_exec(
                    *spec.argv,
                    env=spec.environ(os.environ) | self._owner,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    cwd=spec.cwd,
                )
            ticks = read_start_ticks(process.pid)
            # start_new_session makes the child a session and group leader: its pgid is its pid.
            handle = ProcessHandle(process.pid, process.pid, -1 if ticks is None else ticks, instance_id)
        host = f"[{placement.host}]" if ":" in placement.host else placement.host
        url = f"{scheme(self.engine_tls)}://{host}:{placement.port}"
        self._children[handle] = _Child(process, log_path, url)
        self._urls[handle] = url
        if self._records is not None:
            self._records.put(InstanceRecord.of(placement, handle, url, time.time()))
        return handle

    async def _from_runtime(
        self, spec: LaunchSpec, log_path: Path, instance_id: str
    ) -> tuple[ProcessHandle | None, asyncio.subprocess.Process | None]:
        """The handle and process of a warm runtime that took `spec`, or (None, None)."""
        rt = await self.runtimes.take_soon(spec) if self.runtimes is not None else None
        if rt is None:
            return None, None
        try:
            handle = await self.runtimes.hand_off(rt, spec, log_path)
        except (HandoffError, OSError) as exc:
            log.warning(
                "instance %s: runtime %s did not take the start (%s); starting afresh",
                instance_id,
                rt.id,
                exc,
            )
            return None, None
        return ProcessHandle(
            handle.pid, handle.pgid, handle.start_ticks, instance_id, from_runtime=True
        ), rt.process

    async def running(self) -> list[Running]:
        """The recorded engines of a previous run that still run, for adoption; dead ones' records
        are dropped, and engines marked as ours that no record names are stopped (a previous run's
        warm runtimes among them). Then this run's warm runtimes start."""
        try:
            return await self._running()
        finally:
            if self.runtimes is not None:
                self.runtimes.start()

    async def _running(self) -> list[Running]:
        if self._records is None:
            return []
        found, recorded = [], set()
        for record in self._records.all():
            handle = record.handle
            # TLS turned on or off since it started: it speaks the other, and is replaced.
            other_scheme = not record.url.startswith(scheme(self.engine_tls) + "://")
            if not self.is_alive(handle) or not record.secret or other_scheme:
                if self.is_alive(handle):  # a record from before keys were recorded: unreachable
                    if other_scheme:
                        log.warning(
                            "stopping engine %s: it serves %s, not what this run speaks",
                            record.id,
                            record.url,
                        )
                    await self.stop(handle, 10.0)
                self._records.remove(record.id)
                continue
            recorded.add(handle.pgid)
            self._urls[handle] = record.url
            found.append(
                Running(
                    record.id,
                    record.deployment,
                    record.snapshot_id,
                    handle,
                    record.url,
                    record.secret,
                    record.started_at,
                )
            )
        if self._owner_name is not None:
            mine = self.runtimes.pgids() if self.runtimes is not None else set()
            for handle in marked(self._owner_name):
                if handle.pgid not in recorded | mine and self.is_alive(handle):
                    log.warning(
                        "stopping process %d left by a previous run, which never recorded it", handle.pid
                    )
                    await self.stop(handle, 10.0)
        return found

    async def aclose(self) -> None:
        """The warm runtimes are stopped; the engines, which `stop` reaps, run on."""
        if self.runtimes is not None:
            await self.runtimes.aclose()

    async def read_log(self, instance_id: str, max_bytes: int) -> str | None:
        return await asyncio.to_thread(_read_tail, self.log_path(instance_id), max_bytes)

    async def device_capacity(self) -> tuple[int, str] | None:
        return None  # this machine's: the platform's GPU inventory

    def held_up(self, handle: ProcessHandle) -> str | None:
        return None  # a process runs as soon as it is spawned

    def is_alive(self, handle: ProcessHandle) -> bool:
        """The same process (PID and start time) still runs; a recycled PID does not count."""
        child = self._children.get(handle)
        if child is not None and child.process.returncode is not None:
            return False
        return read_start_ticks(handle.pid) == handle.start_ticks

    async def wait_ready(
        self,
        handle: ProcessHandle,
        timeout_s: float,
        *,
        health_path: str = "/health",
        interval_s: float = 0.1,
    ) -> str:
        """Poll the engine's `health_path` until 200; its base URL. `StartFailed` if the process
        exits first or time runs out; the process is left as it is (the caller stops it).

        The failure's phase is what the polls saw: an engine that exits before its server ever
        answered failed to start (`process_start`: imports, checks, or all of vLLM's start, whose
        server answers only once loaded); one that answered "not ready" first failed loading
        (`model_load`: the CPU engine serves at once and loads in the background); one that runs on
        unready past `timeout_s` is a `wait_ready` failure."""
        url = self._urls[handle]
        deadline = self._clock() + timeout_s
        last = "no answer yet"
        answered = False
        async with aiohttp.ClientSession(connector=connector(self.engine_tls)) as session:
            while True:
                if not self.is_alive(handle):
                    code = await self._exit_code(handle)
                    phase = "model_load" if answered else "process_start"
                    raise self._failed(handle, f"exited with status {code} before it was ready", code, phase)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise self._failed(
                        handle, f"not ready after {timeout_s:g}s (last: {last})", None, "wait_ready"
                    )
                try:
                    timeout = aiohttp.ClientTimeout(total=min(1.0, remaining))
                    async with session.get(url + health_path, timeout=timeout) as r:
                        if r.status == 200:
                            return url
                        answered, last = True, f"HTTP {r.status}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = type(exc).__name__
                await asyncio.sleep(min(interval_s, max(0.0, deadline - self._clock())))

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None:
        """SIGTERM the group, SIGKILL it after `term_timeout_s`; the exit code if this backend started
        the process and it has not been stopped before, else None. Safe to repeat, and on the dead.
        Its record goes once it is gone."""
        child = self._children.get(handle)
        if child is None:
            await self._stop_foreign(handle, term_timeout_s)
            self._forget(handle)
            return None
        process = child.process
        try:
            if process.returncode is None:
                killpg(handle.pgid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), term_timeout_s)
                except TimeoutError:
                    killpg(handle.pgid, signal.SIGKILL)
                    await process.wait()
        except asyncio.CancelledError:
            killpg(handle.pgid, signal.SIGKILL)  # a cancelled stop still leaves nothing running
            raise
        # The leader is gone; anything it left in its group goes now. (A group with members left
        # keeps its id reserved, so this cannot reach a stranger; an empty one answers ESRCH.)
        killpg(handle.pgid, signal.SIGKILL)
        self._children.pop(handle, None)
        self._forget(handle)
        return process.returncode

    def _forget(self, handle: ProcessHandle) -> None:
        self._urls.pop(handle, None)
        if self._records is not None and handle.instance_id:
            self._records.remove(handle.instance_id)

    async def _stop_foreign(self, handle: ProcessHandle, term_timeout_s: float) -> None:
        """A process another run started (from the records): not ours to reap, so poll until gone."""
        if not self.is_alive(handle):
            return None  # already gone, or its PID now names another process: leave that one alone
        killpg(handle.pgid, signal.SIGTERM)
        if not await self._gone_within(handle, term_timeout_s):
            killpg(handle.pgid, signal.SIGKILL)
            await self._gone_within(handle, 5.0)
        killpg(handle.pgid, signal.SIGKILL)
        return None

    async def _gone_within(self, handle: ProcessHandle, seconds: float) -> bool:
        deadline = self._clock() + seconds
        while self.is_alive(handle):
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _exit_code(self, handle: ProcessHandle) -> int | None:
        """The status of a child seen dead; the reaping may trail the death by a moment."""
        child = self._children.get(handle)
        if child is None:
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.process.wait(), 1.0)
        return child.process.returncode

    def _failed(self, handle: ProcessHandle, what: str, code: int | None, phase: str) -> StartFailed:
        child = self._children.get(handle)
        lines = log_tail_lines(child.log_path, FAILURE_LOG_LINES) if child else []
        tail = log_tail(child.log_path) if child else ""
        where = f" ({child.log_path})" if child else ""
        message = f"engine pid {handle.pid} {what}{where}" + (f"; log: {tail}" if tail else "")
        return StartFailed(message, exit_code=code, log_tail=tail, phase=phase, log_lines=tuple(lines))
