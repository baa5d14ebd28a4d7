"""The local backend: engine processes on this machine, each in its own process group.

A process is named by `ProcessHandle(pid, pgid, start_ticks)`: `start_ticks` is the kernel's start
time of the process (`/proc/<pid>/stat`, field 22), so a handle read back after a restart is not
mistaken for an unrelated process that got the same PID later. Stopping signals the whole group,
so whatever the engine spawned goes with it.

Sleep and wake are HTTP calls to the engine itself (`POST /sleep?level=N`, `POST /wake_up`): the CPU
engine and vLLM in its dev mode answer the same routes. Anything but a 200 in time is a `PoolError`
naming the instance and what it answered; the pool then treats the instance as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from warm_pool.errors import PoolError, StartFailed
from warm_pool.launch import LaunchSpec
from warm_pool.vllm import startup_phases

STARTUP_PHASE_METRIC = "stoker_engine_startup_phase_seconds"
Headers = Mapping[str, str] | None  # an instance's `auth_headers`: its key
_LOG_TAIL_LINES = 5
FAILURE_LOG_LINES = 20  # what a failure record keeps of the log: a traceback's last frames and its error
_LOG_TAIL_BYTES = 64 * 1024  # a crash's traceback plus what follows it
_LOG_PHASE_BYTES = 1 << 20  # vLLM logs a few hundred lines while it starts; its phases are in them
_MAX_INFO_BYTES = 1 << 20  # vLLM's /server_info holds its whole config and environment: ~20 KB


@dataclass(frozen=True)
class ProcessHandle:
    pid: int
    pgid: int
    start_ticks: int  # -1 if the process was gone before it could be read


@dataclass
class _Child:
    process: asyncio.subprocess.Process
    log_path: Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS calls free now. Another process may take it before the engine binds it; the
    engine then exits at once and the start fails like any other."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def read_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat; None if there is no such process or it is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 is the command name in parentheses and may itself hold spaces and ")": split after the
    # last ")". What follows starts at field 3 (state), so field 22 is index 19.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine said it can do. An engine that said nothing can do nothing optional."""

    sleep_levels: tuple[int, ...] = ()

    @property
    def can_sleep(self) -> bool:
        return 1 in self.sleep_levels

    @classmethod
    def parse(cls, body: bytes) -> EngineCapabilities:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return cls()
        if not isinstance(doc, dict):
            return cls()
        levels = doc.get("sleep_levels")
        if isinstance(levels, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in levels):
            return cls(tuple(sorted(set(levels))))
        config = doc.get("vllm_config")
        model = config.get("model_config") if isinstance(config, dict) else None
        if isinstance(model, dict) and model.get("enable_sleep_mode") is True:
            return cls((1, 2))  # vLLM's sleep mode: level 1 offloads weights to host, level 2 drops them
        return cls()


def _read_tail(path: Path, nbytes: int) -> str | None:
    """The last `nbytes` of a file as text; None if it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _phases_from_log(path: Path) -> dict[str, float]:
    """vLLM's start phases from the tail of its log (the last start in it, if it was restarted)."""
    text = _read_tail(path, _LOG_PHASE_BYTES)
    return startup_phases(text) if text is not None else {}


# Lines a dying vLLM prints after its error that say nothing about it: nanobind's leak report at
# interpreter exit (dozens of lines) and vLLM's own shutdown chatter.
_NOISE = re.compile(
    r"^nanobind: |^- leaked|^- \.\.\. skipped|\[shutdown\]|^INFO: |resource_tracker|warnings\.warn|refleaks"
)
ERROR_LINE = re.compile(r"\w(Error|Exception)\b|\bERROR\b|^stoker: error: ")
# Terminal escapes (transformers colours its load report) and other control characters: a log
# line shown in a table or a JSON answer carries neither.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")


def log_tail_lines(path: Path, lines: int = _LOG_TAIL_LINES) -> list[str]:
    """The last meaningful lines of a log (at most `lines`, each at most 300 characters). The last
    line that names an error leads, if the tail itself does not hold it."""
    text = _read_tail(path, _LOG_TAIL_BYTES)
    if text is None:
        return []
    cleaned = (_CONTROL.sub("", line).strip() for line in text.splitlines())
    kept = [line for line in cleaned if line and not _NOISE.search(line)]
    tail = kept[-lines:]
    errors = [line for line in kept if ERROR_LINE.search(line) and " WARNING " not in line]
    if errors and errors[-1] not in tail:
        tail = [errors[-1], *tail[-(lines - 1) :]]
    return [line[:300] for line in tail]


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """`log_tail_lines` joined by " | ", to keep a message on one line."""
    return " | ".join(log_tail_lines(path, lines))


OWNER_ENV = "STOKER_ENGINE_OF"  # in every engine's environment: whose it is (see `records.marked`)


class LocalBackend:
    def __init__(
        self, log_dir: Path, clock: Callable[[], float] = time.monotonic, owner: str | None = None
    ) -> None:
        """`owner`, when given, goes into every engine's environment as `OWNER_ENV`, so a later run
        finds the engines of this one even where no record was written (`records.reap_orphans`)."""
        self.log_dir = log_dir
        self._clock = clock
        self._owner = {OWNER_ENV: owner} if owner else {}
        self._children: dict[ProcessHandle, _Child] = {}  # processes this backend started and has not reaped

    def log_path(self, instance_id: str) -> Path:
        return self.log_dir / f"{instance_id}.log"

    async def start(self, instance_id: str, spec: LaunchSpec) -> ProcessHandle:
        """Spawn `spec` in a new session (its own process group), output appended to its log."""
        if not instance_id or "/" in instance_id or instance_id.startswith("."):
            raise ValueError(f"instance id must be a plain file name, got {instance_id!r}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path(instance_id)
        with log_path.open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                *spec.argv,
                env=os.environ | dict(spec.env) | self._owner,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                cwd=spec.cwd,
            )
        ticks = read_start_ticks(process.pid)
        # start_new_session makes the child a session and group leader: its pgid is its pid.
        handle = ProcessHandle(process.pid, process.pid, -1 if ticks is None else ticks)
        self._children[handle] = _Child(process, log_path)
        return handle

    def is_alive(self, handle: ProcessHandle) -> bool:
        """The same process (PID and start time) still runs; a recycled PID does not count."""
        child = self._children.get(handle)
        if child is not None and child.process.returncode is not None:
            return False
        return read_start_ticks(handle.pid) == handle.start_ticks

    async def wait_ready(
        self,
        handle: ProcessHandle,
        url: str,
        timeout_s: float,
        interval_s: float = 0.1,
        *,
        health_path: str = "/health",
    ) -> None:
        """Poll `url + health_path` until 200. `StartFailed` if the process exits first or time runs
        out; the process is left as it is (the caller stops it).

        The failure's phase is what the polls saw: an engine that exits before its server ever
        answered failed to start (`process_start`: imports, checks, or all of vLLM's start, whose
        server answers only once loaded); one that answered "not ready" first failed loading
        (`model_load`: the CPU engine serves at once and loads in the background); one that runs on
        unready past `timeout_s` is a `wait_ready` failure."""
        deadline = self._clock() + timeout_s
        last = "no answer yet"
        answered = False
        async with aiohttp.ClientSession() as session:
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
                            return
                        answered, last = True, f"HTTP {r.status}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = type(exc).__name__
                await asyncio.sleep(min(interval_s, max(0.0, deadline - self._clock())))

    async def stop(self, handle: ProcessHandle, term_timeout_s: float) -> int | None:
        """SIGTERM the group, SIGKILL it after `term_timeout_s`; the exit code if this backend started
        the process and it has not been stopped before, else None. Safe to repeat, and on the dead."""
        child = self._children.get(handle)
        if child is None:
            return await self._stop_foreign(handle, term_timeout_s)
        process = child.process
        try:
            if process.returncode is None:
                _killpg(handle.pgid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), term_timeout_s)
                except TimeoutError:
                    _killpg(handle.pgid, signal.SIGKILL)
                    await process.wait()
        except asyncio.CancelledError:
            _killpg(handle.pgid, signal.SIGKILL)  # a cancelled stop still leaves nothing running
            raise
        # The leader is gone; anything it left in its group goes now. (A group with members left
        # keeps its id reserved, so this cannot reach a stranger; an empty one answers ESRCH.)
        _killpg(handle.pgid, signal.SIGKILL)
        self._children.pop(handle, None)
        return process.returncode

    async def _stop_foreign(self, handle: ProcessHandle, term_timeout_s: float) -> None:
        """A process another run started (from the records): not ours to reap, so poll until gone."""
        if not self.is_alive(handle):
            return None  # already gone, or its PID now names another process: leave that one alone
        _killpg(handle.pgid, signal.SIGTERM)
        if not await self._gone_within(handle, term_timeout_s):
            _killpg(handle.pgid, signal.SIGKILL)
            await self._gone_within(handle, 5.0)
        _killpg(handle.pgid, signal.SIGKILL)
        return None

    async def _gone_within(self, handle: ProcessHandle, seconds: float) -> bool:
        deadline = self._clock() + seconds
        while self.is_alive(handle):
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def sleep(self, url: str, level: int, timeout_s: float, headers: Headers = None) -> None:
        """Put the engine at `url` to sleep (level 1: weights to host RAM, accelerator freed)."""
        await _post(url, f"/sleep?level={level}", timeout_s, headers)

    async def wake_up(self, url: str, timeout_s: float, headers: Headers = None) -> None:
        """Wake the engine at `url`: weights back, ready for requests when this returns."""
        await _post(url, "/wake_up", timeout_s, headers)

    async def read_startup_phases(
        self, url: str, instance_id: str | None = None, headers: Headers = None
    ) -> dict[str, float]:
        """`{phase: seconds}` from the engine's `stoker_engine_startup_phase_seconds`, else (vLLM)
        from the phases vLLM logged (`warm_pool.vllm.startup_phases`); `{}` if neither can be read:
        these numbers are informative only."""
        phases = await self._phases_from_metrics(url, headers)
        if not phases and instance_id is not None:
            phases = await asyncio.to_thread(_phases_from_log, self.log_path(instance_id))
        return phases

    async def read_capabilities(self, url: str, headers: Headers = None) -> EngineCapabilities:
        """What the engine at `url` says it can do (`GET /server_info?config_format=json`): the CPU
        engine lists its sleep levels; vLLM reports its config, whose `enable_sleep_mode` means levels
        1 and 2. An engine without that route (vLLM outside dev mode, where /sleep is not served
        either) cannot be put to sleep."""
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    url + "/server_info",
                    params={"config_format": "json"},
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as r,
            ):
                if r.status != 200:
                    return EngineCapabilities()
                body = await r.content.read(_MAX_INFO_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError):
            return EngineCapabilities()
        return EngineCapabilities.parse(body[:_MAX_INFO_BYTES] if len(body) <= _MAX_INFO_BYTES else b"")

    async def _phases_from_metrics(self, url: str, headers: Headers = None) -> dict[str, float]:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(url + "/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r,
            ):
                if r.status != 200:
                    return {}
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            return {}
        phases: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                if family.name != STARTUP_PHASE_METRIC:
                    continue
                for sample in family.samples:
                    if "phase" in sample.labels:
                        phases[sample.labels["phase"]] = sample.value
        except ValueError:
            return {}
        return phases

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


async def _post(url: str, path: str, timeout_s: float, headers: Headers = None) -> None:
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r,
        ):
            if r.status != 200:
                body = (await r.text())[:200].replace("\n", " ")
                raise PoolError(f"POST {url}{path} answered {r.status}: {body}")
    except (aiohttp.ClientError, OSError) as exc:
        raise PoolError(f"POST {url}{path} failed: {type(exc).__name__}: {exc}") from None
    except TimeoutError:
        raise PoolError(f"POST {url}{path}: no answer within {timeout_s:g}s") from None


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
