"""The warm-runtime keeper: engine processes started ahead of need, one tier above the page cache.

ARCHITECTURE.md's tier table: "an engine process with its imports done (and on a GPU its CUDA
context), no model | host RAM | weight load only". The keeper holds `count` runtimes of each engine
kind (`RuntimeKind`; `stoker up --warm-runtimes N`, 1 by default for the CPU engine, 0 turns the
tier off), an on-demand kind's (the CPU engine's) only once a deployment of its engine exists
(`want`, from the control plane's pools): a platform that serves none holds none. The local backend (`warm_pool.backends.local`) asks it for one at every start (`take`): a ready
runtime whose kind runs that launch is handed the launch over its socket (`warm_pool.handoff`) and
becomes the instance's engine, same PID; with none ready the start spawns a fresh process as before.
A runtime taken is replaced by its successor: a kind that `forks` (the CPU engine's) is sent, with
the handoff, the directory and token of the runtime it forks before it becomes the engine
(`warm_pool.succession`), a copy with every import done that listens within milliseconds, which the
keeper adopts (this process is made a child subreaper, so the successor becomes its child) and
reaps. Being a subreaper, this process also receives whatever else is orphaned below it (an
engine's own children, left when the engine's group is stopped): the loop reaps those zombies
(`reap_orphans`) every `memory_interval_s`. A start that finds no ready runtime while one that could take it is due (a successor) or
starting (its imports under way) waits for it (`take_soon`, at most `wait_s`), so K starts in a
burst each take the runtime path, and a start just after the platform came up does not spawn a
second process importing beside the runtime's. A kind that does not
fork (a runtime holding a CUDA context: a fork does not carry it), or a successor that did not come
up, is replaced in the background, `refill_delay_s` (10 s) later, so that the replacement's imports
do not compete with the new engine's first requests for the CPU.

Its loop, every `interval_s` and at once after a take: a runtime whose socket has appeared is ready;
one that died, or was not ready within `ready_timeout_s`, is dropped and counts as a failure, and the
next start of its kind waits `restart_delay(failures)` (1 s, 2 s, 4 s … 60 s; a ready one resets it);
then `to_start` says how many to spawn. Each runtime's memory is read from /proc every
`memory_interval_s` (RSS and PSS; PSS splits the pages shared with other processes, such as the
torch libraries every engine maps, so summed PSS is what the runtimes cost the machine): gauges
`stoker_warm_runtimes{engine}` (ready ones) and `stoker_warm_runtime_memory_bytes{engine, kind}`
(kind rss or pss), `status()` for operators, and `fleet_members()` for the arbiter.

Runtimes run in process groups of their own and carry the owner mark of the backend's engines, so
`aclose` stops each whole group and a run that died leaves none the next run does not stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from warm_pool.backends.procs import (
    OWNER_ENV,
    AdoptedProcess,
    ProcessHandle,
    killpg,
    read_start_ticks,
    reap_orphans,
)
from warm_pool.backoff import restart_delay
from warm_pool.census import Member
from warm_pool.fleet import CPU_DEVICE, Fleet
from warm_pool.handoff import (
    KEEPER_ENV,
    SOCKET_NAME,
    TOKEN_ENV,
    Handoff,
    HandoffError,
    Successor,
    fits,
    hand_off,
    private_dir,
)
from warm_pool.launch import LaunchSpec, default_stoker_command, with_python_path
from warm_pool.succession import become_subreaper

log = logging.getLogger("warm_pool.runtimes")
RUNTIMES_MEMBER = "(warm runtimes)"  # their name among the fleet's members: no deployment has it


@dataclass(frozen=True)
class RuntimeKind:
    """One engine kind's runtimes: how to start one, how many to keep, which launches it takes.

    `engine` is the pool's engine name ("cpu", "vllm"); `command` starts a runtime (the keeper adds
    `--socket-dir DIR`); a launch is taken when its `program` is `program` and its arguments begin
    with `first_args` and the directories of its `python_path` are among the runtime's (started
    ahead on its PYTHONPATH: an interpreter reads that once). `device_bytes` is device memory a
    runtime holds on `device` (a GPU runtime's CUDA context, a configured figure); a CPU runtime's
    host memory is measured instead. `forks`: its runtimes fork their successor at each handoff
    (`warm_pool.succession`; never one holding a CUDA context). `on_demand`: none is kept before a
    deployment of its engine exists (`RuntimeKeeper.want`): a platform that serves no model of
    that engine holds no runtime's memory."""

    engine: str
    command: tuple[str, ...]
    count: int = 1
    program: str = "stoker"
    first_args: tuple[str, ...] = ("engine",)
    device: str | None = None
    device_bytes: int = 0
    python_path: tuple[str, ...] = ()
    forks: bool = False
    on_demand: bool = False

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"warm runtimes of {self.engine} must be 0 or more, got {self.count}")

    def takes(self, spec: LaunchSpec) -> bool:
        return (
            spec.program == self.program
            and spec.args[: len(self.first_args)] == self.first_args
            and set(spec.python_path) <= set(self.python_path)
        )


@dataclass
class Runtime:
    id: str
    kind: RuntimeKind
    process: asyncio.subprocess.Process | AdoptedProcess  # adopted: a successor (`warm_pool.succession`)
    handle: ProcessHandle
    directory: Path
    token: str = field(repr=False)
    env: Mapping[str, str] = field(repr=False)
    log_path: Path
    started_at: float
    ready_at: float | None = None
    rss: int = 0
    pss: int = 0

    @property
    def socket(self) -> Path:
        return self.directory / SOCKET_NAME


def to_start(count: int, live: int, now: float, not_before: float) -> int:
    """How many runtimes to spawn now: the shortfall of `live` (starting or ready) against `count`,
    none before `not_before` (the backoff after a failure). Pure.

    >>> to_start(2, 0, now=10.0, not_before=0.0), to_start(2, 0, now=10.0, not_before=12.0)
    (2, 0)
    """
    if now < not_before:
        return 0
    return max(0, count - live)


def memory_of(pid: int, proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """(RSS, PSS) bytes of a process from `smaps_rollup`; None if it cannot be read.

    `Rss:  402312 kB` → 411,967,488 bytes."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            found[key] = int(rest.split()[0]) * 1024
    return (found["Rss"], found["Pss"]) if len(found) == 2 else None


class RuntimeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ready = Gauge(
            "stoker_warm_runtimes",
            "Warm runtimes ready to take a start (imports done, no model), by engine.",
            ["engine"],
            registry=registry,
        )
        self.memory = Gauge(
            "stoker_warm_runtime_memory_bytes",
            "Memory the warm runtimes hold, by engine: kind rss (resident) or pss (shared pages split).",
            ["engine", "kind"],
            registry=registry,
        )


class RuntimeKeeper:
    def __init__(
        self,
        kinds: Sequence[RuntimeKind],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,  # added to every runtime's environment (the owner mark)
        metrics: RuntimeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 0.2,
        ready_timeout_s: float = 600.0,
        memory_interval_s: float = 5.0,
        refill_delay_s: float = 10.0,  # after a take, before its replacement starts importing
        wait_s: float = 30.0,  # the longest a start waits for a runtime due or starting (`take_soon`)
    ) -> None:
        if len({k.engine for k in kinds}) != len(kinds):
            raise ValueError("one runtime kind per engine")
        self.kinds = {k.engine: k for k in kinds}
        self.log_dir = log_dir
        self._env = dict(env or {})
        self._metrics = metrics
        self._clock = clock
        self._interval_s = interval_s
        self._ready_timeout_s = ready_timeout_s
        self._memory_interval_s = memory_interval_s
        self._refill_delay_s = refill_delay_s
        self._wait_s = wait_s
        self._runtimes: dict[str, Runtime] = {}
        self._due = dict.fromkeys(self.kinds, 0)  # successors of runtimes being handed off, by engine
        self._changed = asyncio.Event()  # set (and replaced) when a successor comes or will not
        self._subreaper: bool | None = None  # made one at the first start of a kind that forks
        self._orphans: list[AdoptedProcess] = []  # successors not kept, to reap once they are gone
        self._wanted: set[str] = set()  # engines with a deployment: on-demand kinds are kept from then on
        self._failures = dict.fromkeys(self.kinds, 0)
        self._not_before = dict.fromkeys(self.kinds, 0.0)
        self._measured_at = -float("inf")
        self._root: Path | None = None  # a private directory for the sockets, short (a socket path
        self._task: asyncio.Task | None = None  # must fit in 108 bytes)
        self._poke = asyncio.Event()
        self._closing = False
        self._started = False
        self.host_device: str | None = None  # the fleet's CPU budget, where runtimes' RAM counts

    # ---- what the backend and operators ask -----------------------------------------------------------

    def want(self, engine: str) -> None:
        """A deployment of `engine` exists: keep its on-demand runtimes from now on (for as long as
        the keeper runs)."""
        if engine not in self._wanted:
            self._wanted.add(engine)
            self._poke.set()

    def kept(self, kind: RuntimeKind) -> int:
        """How many runtimes of `kind` to keep now: its count, or none while it waits for demand."""
        return kind.count if not kind.on_demand or kind.engine in self._wanted else 0

    def ready(self, engine: str) -> int:
        return sum(1 for r in self._runtimes.values() if r.kind.engine == engine and r.ready_at is not None)

    def take(self, spec: LaunchSpec) -> Runtime | None:
        """A ready runtime that can run `spec`, now the caller's (the keeper replaces it), or None."""
        for rt in sorted(self._runtimes.values(), key=lambda r: r.started_at):
            if rt.ready_at is None or not rt.kind.takes(spec) or rt.process.returncode is not None:
                continue
            if (why := fits(spec.env, rt.env)) is not None:
                log.info("runtime %s cannot take this start: %s", rt.id, why)
                continue
            del self._runtimes[rt.id]
            engine = rt.kind.engine
            if self._forks(rt.kind):
                self._due[engine] += 1  # its successor replaces it (`hand_off`)
            else:
                self._delay_refill(engine)
            self._poke.set()
            self._gauges()
            return rt
        return None

    async def take_soon(self, spec: LaunchSpec) -> Runtime | None:
        """`take`, or, with none ready while one that could run `spec` is on its way, that one once it
        is ready: a successor due (a burst: the previous start's handoff is under way) or a runtime
        starting (its imports under way: a fresh process spawned now would only finish its imports
        later, sharing the CPU with it). None when none is on its way, or none came within `wait_s`."""
        end = self._clock() + self._wait_s
        while (rt := self.take(spec)) is None:
            left = end - self._clock()
            if not self._on_its_way(spec) or left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, self._interval_s)):
                    await self._changed.wait()
        return rt

    def _on_its_way(self, spec: LaunchSpec) -> bool:
        """A runtime that could take `spec` is due (a successor: its environment is its parent's,
        the keeper's for its kind) or starting."""
        for kind in self.kinds.values():
            env = with_python_path(os.environ | self._env, kind.python_path)
            if self._due[kind.engine] and kind.takes(spec) and fits(spec.env, env) is None:
                return True
        return any(
            r.ready_at is None
            and r.process.returncode is None
            and r.kind.takes(spec)
            and fits(spec.env, r.env) is None
            for r in self._runtimes.values()
        )

    def _forks(self, kind: RuntimeKind) -> bool:
        return kind.forks and bool(self._subreaper)

    def _delay_refill(self, engine: str) -> None:
        # The replacement's imports wait `refill_delay_s`: begun at once they take the CPU from the
        # engine just handed off, whose first request is the one that waits (measured on 2 cores:
        # READY → first token 4.3-9.1 s after a runtime start with an immediate refill, 3.0-5.3 s
        # after a fresh start, bench/runtime_bench.py at load 4-7).
        self._not_before[engine] = max(self._not_before[engine], self._clock() + self._refill_delay_s)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def hand_off(self, rt: Runtime, spec: LaunchSpec, log_path: Path) -> ProcessHandle:
        """Hand `spec` to `rt`, its output going to `log_path` (appended, opened without following a
        link); the engine's handle (the runtime's). A kind that forks is sent its successor too,
        adopted here once the answer names it. On `HandoffError` or `OSError` the runtime is
        stopped: a runtime taken is the caller's, handed off or gone."""
        successor = self._successor_of(rt) if self._forks(rt.kind) else None
        try:
            try:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                fd = _open_log(log_path)
            except OSError:
                await self._stop(rt)
                raise
            handoff = Handoff(
                spec.args,
                dict(spec.env),
                str(spec.cwd) if spec.cwd is not None else None,
                successor.handoff if successor is not None else None,
            )
            try:
                answer = await asyncio.to_thread(
                    hand_off,
                    rt.socket,
                    handoff,
                    rt.token,
                    expect_pid=rt.handle.pid,
                    log_fd=fd,
                    successor_log_fd=successor.log_fd if successor is not None else None,
                )
            except HandoffError:
                await self._stop(rt)
                raise
            finally:
                os.close(fd)
            if successor is not None:
                self._adopt(successor, answer.successor_pid)
                successor = None
        finally:
            if successor is not None:  # the handoff failed: no successor
                self._adopt(successor, None)
        self._discard(rt, keep_log=False)
        return rt.handle

    def _successor_of(self, rt: Runtime) -> _Planned | None:
        """The directory, token and log of the successor `rt` is to fork; None (and the replacement
        is spawned after `refill_delay_s`) if they cannot be made."""
        ident = f"{rt.kind.engine}-{secrets.token_hex(4)}"
        try:
            directory = private_dir(self._root / ident)
            log_path = self.log_dir / f"{ident}.log"
            log_fd = _open_log(log_path)
        except (HandoffError, OSError) as exc:
            log.warning("no successor for runtime %s: %s", rt.id, exc)
            self._due[rt.kind.engine] -= 1
            self._delay_refill(rt.kind.engine)
            self._notify()
            return None
        token = secrets.token_urlsafe(32)
        return _Planned(ident, rt, Successor(str(directory), token), token, log_path, log_fd)

    def _adopt(self, planned: _Planned, pid: int | None) -> None:
        """Keep the successor the runtime answered with (`pid`), ready: its socket listened before
        the answer came. None, or one gone already: the replacement is spawned instead."""
        os.close(planned.log_fd)
        engine, now = planned.parent.kind.engine, self._clock()
        self._due[engine] -= 1
        ticks = read_start_ticks(pid) if pid is not None else None
        directory = Path(planned.handoff.dir)
        if ticks is None or not (directory / SOCKET_NAME).exists() or self._closing:
            if pid is not None:
                log.warning("runtime %s: its successor %d cannot be kept", planned.parent.id, pid)
                if ticks is not None:  # it runs (a session leader: its group is its own)
                    killpg(pid, signal.SIGKILL)
                self._orphans.append(AdoptedProcess(pid, -1 if ticks is None else ticks))
            shutil.rmtree(directory, ignore_errors=True)
            with contextlib.suppress(OSError):
                planned.log_path.unlink()
            self._delay_refill(engine)
        else:
            process = AdoptedProcess(pid, ticks)
            handle = ProcessHandle(pid, pid, ticks, from_runtime=True)  # a session leader
            self._runtimes[planned.ident] = Runtime(
                planned.ident,
                planned.parent.kind,
                process,
                handle,
                directory,
                planned.token,
                planned.parent.env,
                planned.log_path,
                now,
                ready_at=now,
            )
            log.info("runtime %s (pid %d) forked by %s at its handoff", planned.ident, pid, planned.parent.id)
        self._poke.set()
        self._notify()
        self._gauges()

    def status(self) -> list[dict]:
        """Each runtime as an operator sees it."""
        return [
            {
                "id": rt.id,
                "engine": rt.kind.engine,
                "pid": rt.handle.pid,
                "state": "ready" if rt.ready_at is not None else "starting",
                "rss_bytes": rt.rss,
                "pss_bytes": rt.pss,
                "log": str(rt.log_path),
            }
            for rt in sorted(self._runtimes.values(), key=lambda r: r.started_at)
        ]

    def pgids(self) -> set[int]:
        return {rt.handle.pgid for rt in self._runtimes.values()}

    # ---- the fleet's view (a `warm_pool.fleet.FleetMember` that wishes nothing) -------------------------

    name = RUNTIMES_MEMBER

    def fleet_wish(self) -> None:
        return None

    def poke(self) -> None:
        """The fleet's nudge: nothing to decide here."""

    def fleet_members(self) -> list[Member]:
        """Memory the runtimes hold, as members of no deployment (the arbiter counts them as held):
        a kind's configured `device_bytes` on its device, and, on `host_device` (a CPU budget the
        composition root names), each runtime's measured PSS."""
        members, host_device = [], self.host_device
        for rt in self._runtimes.values():
            if rt.kind.device is not None and rt.kind.device_bytes > 0:
                members.append(
                    Member(rt.id, RUNTIMES_MEMBER, rt.kind.device, False, holds=rt.kind.device_bytes)
                )
            if host_device is not None and rt.pss > 0:
                members.append(Member(rt.id, RUNTIMES_MEMBER, host_device, False, holds=rt.pss))
        return members

    # ---- the loop --------------------------------------------------------------------------------------

    def add_kind(self, kind: RuntimeKind) -> None:
        """Keep runtimes of another engine kind from now on (one whose runtime command is known only
        later: vLLM's, found at the first vLLM deployment). Refused for an engine already kept."""
        if kind.engine in self.kinds:
            raise ValueError(f"runtimes of {kind.engine} are kept already")
        self.kinds[kind.engine] = kind
        self._failures[kind.engine], self._not_before[kind.engine] = 0, 0.0
        self._due[kind.engine] = 0
        if self._started:
            self.start()
        self._poke.set()

    def start(self) -> None:
        """Start keeping runtimes (in the background); safe to repeat. Where a kind forks, this
        process becomes a child subreaper first, so the successors become its children."""
        self._started = True
        if self._subreaper is None and any(k.forks and k.count for k in self.kinds.values()):
            self._subreaper = become_subreaper()
            if not self._subreaper:
                log.warning("cannot become a child subreaper: warm runtimes are replaced by fresh ones")
        if self._task is None and not self._closing and any(k.count for k in self.kinds.values()):
            self._root = Path(tempfile.mkdtemp(prefix="stoker-rt-"))  # 0700, short
            self._task = asyncio.create_task(self._run(), name="warm-runtimes")

    async def aclose(self) -> None:
        """Stop every runtime (each whole process group) and the loop."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(
            *(self._stop(rt) for rt in list(self._runtimes.values())), return_exceptions=True
        )
        with contextlib.suppress(TimeoutError):  # successors not kept, killed already: reaped
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self._orphans)), 5.0)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._gauges()

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self._step()
            except Exception:  # one bad step must not end the tier
                log.exception("warm runtimes: step failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._poke.wait()
            self._poke.clear()

    async def _step(self) -> None:
        now = self._clock()
        self._orphans = [p for p in self._orphans if p.returncode is None]
        for rt in list(self._runtimes.values()):
            if rt.process.returncode is not None:
                self._failed(rt, f"exited with status {rt.process.returncode}", now)
                self._discard(rt, keep_log=True)
            elif rt.ready_at is None and rt.socket.exists():
                rt.ready_at = now
                self._failures[rt.kind.engine] = 0
                log.info("runtime %s (pid %d) ready after %.2fs", rt.id, rt.handle.pid, now - rt.started_at)
            elif rt.ready_at is None and now - rt.started_at > self._ready_timeout_s:
                self._failed(rt, f"not ready after {self._ready_timeout_s:g}s", now)
                await self._stop(rt, keep_log=True)
        for kind in self.kinds.values():
            live = self._due[kind.engine] + sum(
                1 for r in self._runtimes.values() if r.kind.engine == kind.engine
            )
            for _ in range(to_start(self.kept(kind), live, now, self._not_before[kind.engine])):
                await self._spawn(kind, now)
        if now - self._measured_at >= self._memory_interval_s:
            self._measured_at = now
            if self._subreaper and (orphans := reap_orphans()):
                log.info("reaped %d orphaned process(es) of stopped engines: %s", len(orphans), orphans)
            for rt in self._runtimes.values():
                rt.rss, rt.pss = memory_of(rt.handle.pid) or (rt.rss, rt.pss)
        self._gauges()

    def _failed(self, rt: Runtime, why: str, now: float) -> None:
        engine = rt.kind.engine
        delay = restart_delay(self._failures[engine])
        self._failures[engine] += 1
        self._not_before[engine] = now + delay
        log.warning(
            "runtime %s (pid %d) %s (log %s); next in %gs", rt.id, rt.handle.pid, why, rt.log_path, delay
        )

    async def _spawn(self, kind: RuntimeKind, now: float) -> None:
        ident = f"{kind.engine}-{secrets.token_hex(4)}"
        directory = private_dir(self._root / ident)
        token = secrets.token_urlsafe(32)
        env = with_python_path(os.environ | self._env, kind.python_path)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{ident}.log"
        try:
            with log_path.open("ab") as out:
                process = await asyncio.create_subprocess_exec(
                    *kind.command,
                    "--socket-dir",
                    str(directory),
                    env={**env, TOKEN_ENV: token, KEEPER_ENV: str(os.getpid())},
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            self._not_before[kind.engine] = now + restart_delay(self._failures[kind.engine])
            self._failures[kind.engine] += 1
            log.error("cannot start a %s runtime: %s", kind.engine, exc)
            return
        ticks = read_start_ticks(process.pid)
        handle = ProcessHandle(process.pid, process.pid, -1 if ticks is None else ticks, from_runtime=True)
        self._runtimes[ident] = Runtime(ident, kind, process, handle, directory, token, env, log_path, now)

    async def _stop(self, rt: Runtime, *, keep_log: bool = False, term_timeout_s: float = 5.0) -> None:
        """SIGTERM its group, SIGKILL after `term_timeout_s`, then whatever the group left."""
        if rt.process.returncode is None:
            killpg(rt.handle.pgid, signal.SIGTERM)
            try:
                await asyncio.wait_for(rt.process.wait(), term_timeout_s)
            except TimeoutError:
                killpg(rt.handle.pgid, signal.SIGKILL)
                await rt.process.wait()
        killpg(rt.handle.pgid, signal.SIGKILL)
        self._discard(rt, keep_log=keep_log)

    def _discard(self, rt: Runtime, *, keep_log: bool) -> None:
        self._runtimes.pop(rt.id, None)
        shutil.rmtree(rt.directory, ignore_errors=True)
        if not keep_log:
            with contextlib.suppress(OSError):
                rt.log_path.unlink()
        self._gauges()

    def _gauges(self) -> None:
        if self._metrics is None:
            return
        for engine in self.kinds:
            mine = [r for r in self._runtimes.values() if r.kind.engine == engine]
            self._metrics.ready.labels(engine).set(self.ready(engine))
            self._metrics.memory.labels(engine, "rss").set(sum(r.rss for r in mine))
            self._metrics.memory.labels(engine, "pss").set(sum(r.pss for r in mine))


@dataclass
class _Planned:
    """A successor asked for in a handoff, before the answer names its PID."""

    ident: str
    parent: Runtime
    handoff: Successor
    token: str = field(repr=False)
    log_path: Path
    log_fd: int


def _open_log(path: Path) -> int:
    """`path` opened to append, created 0600, never through a link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def cpu_keeper(
    count: int,
    log_dir: Path,
    owner: str | None,
    registry: CollectorRegistry,
    fleet: Fleet | None = None,
    *,
    keep: bool = False,
) -> RuntimeKeeper | None:
    """The composition root's keeper of `count` CPU-engine runtimes (`stoker runtime`), logging
    under `log_dir/runtimes`, marked as `owner`'s like its engines, and registered with the `fleet`
    (if any) so their memory counts there (on a CPU budget, their measured PSS); None for 0: the
    tier is off, unless `keep` (another kind joins later: `RuntimeKeeper.add_kind`)."""
    if count < 0:
        raise ValueError(f"--warm-runtimes must be 0 (off) or more, got {count}")
    if count == 0 and not keep:
        return None
    command = (*default_stoker_command(), "runtime")
    kinds = [RuntimeKind("cpu", command, count, forks=True, on_demand=True)] if count else []
    env = {OWNER_ENV: owner} if owner else {}
    keeper = RuntimeKeeper(kinds, log_dir / "runtimes", env=env, metrics=RuntimeMetrics(registry))
    if fleet is not None:
        cpu = any(d.id == CPU_DEVICE for d in fleet.devices.devices)
        keeper.host_device = CPU_DEVICE if cpu else None
        fleet.register(keeper)
    return keeper
