"""A warm runtime's successor: the runtime it forks at its hand-off, so a burst of starts stays warm.

A warm runtime (`warm_pool.runtimes`) is used up by the start it takes: it becomes that engine. The
keeper once replaced it by spawning a fresh runtime, whose imports cost seconds of CPU (7.5 CPU-s
for the CPU engine's), so the second deployment to start in a burst found the tier empty and paid
a full start. Instead, before it becomes the engine, the runtime forks its successor: a copy of
itself with every import done, sharing its pages until either writes them, listening for the next
handoff within milliseconds. The keeper sent the successor's directory and token with the handoff
(`warm_pool.handoff.Successor`) and hears its PID in the answer.

The fork is a double one, so the successor belongs to the keeper and to no engine:

    keeper ─ runtime (becomes the engine) ─ intermediate ─ successor
                                            (exits at once)

The intermediate exits at once, the engine reaps it, and the kernel hands the orphaned successor
to the nearest ancestor that is a child subreaper (`become_subreaper`): the keeper's process, which
reaps it as its own child (`warm_pool.backends.procs.AdoptedProcess`). The successor starts a
session of its own (so it is in no engine's process group and a `killpg` of the engine leaves it),
makes its log its output, waits until the keeper is its parent, and only then arms its death
signal (armed earlier, the intermediate's exit would fire it). Where the keeper is not its parent
(a keeper that is no subreaper, or one gone already) it exits: no one would hand it a start or
reap it. What the successor does not inherit: the handoff's environment and directory (the fork
comes before `take_over`), the engine's log, connection or listener (closed in the child).

Standard library only, like `warm_pool.handoff`, so an engine's own environment can fork the same
way. Forking is for runtimes without a CUDA context: a child does not inherit one that works.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from warm_pool.handoff import (
    Handoff,
    HandoffError,
    Successor,
    death_signal,
    listen,
    reply,
    serve_one,
    take_over,
)

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
REPARENT_WAIT_S = 2.0  # the intermediate exits right after its fork: the kernel reparents at once
READY_WAIT_S = 5.0  # the engine waits this long for its successor to listen, then answers without it
_PID = struct.Struct("i")


@dataclass
class Forked:
    """What `fork_successor` returns in each process: in the engine-to-be, the successor's PID
    (None: it did not come up); in the successor, its listener and token (`pid` None)."""

    pid: int | None = None
    listener: socket.socket | None = None
    token: str | None = None

    @property
    def in_successor(self) -> bool:
        return self.listener is not None


def become_engine(
    listener: socket.socket,
    token: str,
    *,
    forks: bool,
    refuse: Callable[[Handoff], str | None] = lambda handoff: None,
) -> Handoff:
    """A runtime's life up to the engine it becomes: wait for a handoff on `listener` (with
    `token`), refuse it if `refuse` says why (answered, then `HandoffError`, as for anything wrong
    with the message), fork the successor it names where this runtime `forks` (and in the
    successor, go on waiting with its own listener and token), then take it over. Returns the
    handoff to run; the caller runs its program."""
    while True:
        handoff, conn, log_fd = serve_one(listener, token)
        why = refuse(handoff)
        if why is not None:
            reply(conn, {"ok": False, "error": why})
            conn.close()
            raise HandoffError(why)
        successor_pid = None
        if handoff.successor is not None and forks:
            forked = fork_successor(handoff.successor, conn, listener, log_fd)
            if forked.in_successor:
                listener, token = forked.listener, forked.token
                print(f"runtime pid {os.getpid()}: forked at a handoff, imports done; waiting", flush=True)
                continue
            successor_pid = forked.pid
        take_over(handoff, conn, log_fd, listener, successor_pid=successor_pid)
        return handoff


def become_subreaper() -> bool:
    """Make this process a child subreaper: orphans among its descendants become its children,
    which it must reap. False where the system has no such thing (not Linux) or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def fork_successor(successor: Successor, *close: socket.socket | int | None) -> Forked:
    """Fork this runtime's successor (the module docstring says how); `close` are what the successor
    must not keep (the engine's connection, listener and log). Returns in both processes, like
    `os.fork`: `Forked.in_successor` says which. The engine-to-be waits at most `READY_WAIT_S` for
    the successor to listen; it never raises (a successor that fails is one the keeper replaces)."""
    if successor.keeper_pid is None or successor.log_fd is None:
        return Forked()
    # Everything alive now goes to the collector's permanent generation, in both processes: a
    # collection then never writes the shared objects' headers, which would copy their pages.
    gc.freeze()
    read_end, write_end = os.pipe()
    try:
        intermediate = os.fork()
    except OSError:
        _close(read_end, write_end)
        return Forked()
    if intermediate == 0:  # the intermediate
        try:
            os.close(read_end)
            if os.fork() == 0:
                return _become(successor, write_end, close)
        except BaseException:  # a child must never return into the parent's code
            os._exit(1)
        os._exit(0)
    os.close(write_end)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(intermediate, 0)
    try:
        ready, _, _ = select.select([read_end], [], [], READY_WAIT_S)
        data = os.read(read_end, _PID.size) if ready else b""
    finally:
        os.close(read_end)
    return Forked(pid=_PID.unpack(data)[0] if len(data) == _PID.size else None)


def _become(successor: Successor, ready_fd: int, close: tuple) -> Forked:
    """In the successor: its own session, its log, the keeper as parent, then its listener."""
    try:
        for item in close:
            if isinstance(item, socket.socket):
                item.close()
            elif item is not None:
                _close(item)
        os.setsid()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(successor.log_fd, 1)
        os.dup2(successor.log_fd, 2)
        os.close(successor.log_fd)
        end = time.monotonic() + REPARENT_WAIT_S
        while os.getppid() != successor.keeper_pid:
            if time.monotonic() > end:
                print(
                    f"runtime pid {os.getpid()}: its keeper {successor.keeper_pid} is not its parent "
                    f"(parent {os.getppid()}): exiting",
                    flush=True,
                )
                os._exit(0)
            time.sleep(0.001)
        death_signal(signal.SIGTERM)
        if os.getppid() != successor.keeper_pid:  # the keeper died before the signal was armed
            os._exit(0)
        listener = listen(Path(successor.dir))
        os.write(ready_fd, _PID.pack(os.getpid()))
        os.close(ready_fd)
    except (HandoffError, OSError) as exc:
        with contextlib.suppress(Exception):
            print(f"runtime pid {os.getpid()}: cannot become a successor: {exc}", flush=True)
        os._exit(1)
    return Forked(listener=listener, token=successor.token)


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
