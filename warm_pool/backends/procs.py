"""Local processes, named so that a recycled PID is never mistaken for ours."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

OWNER_ENV = "STOKER_ENGINE_OF"  # in every engine's environment: whose it is (see `records.marked`)


@dataclass(frozen=True)
class ProcessHandle:
    pid: int
    pgid: int
    start_ticks: int  # -1 if the process was gone before it could be read
    instance_id: str = ""  # the instance it runs, where known (its record's name)
    # A warm runtime (`warm_pool.runtimes`) became this engine: the start skipped the imports. Not
    # part of its identity (a handle read back from a record is the same process).
    from_runtime: bool = field(default=False, compare=False)

    @property
    def name(self) -> str:
        return f"pid {self.pid}"


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


def killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class AdoptedProcess:
    """A child this process did not spawn but must reap: a warm runtime's successor, forked twice
    from a runtime and handed to this process by the kernel (a child subreaper,
    `warm_pool.succession`), and the engine it later becomes. The part of `asyncio.subprocess.Process`
    the keeper and the backend use (`pid`, `returncode`, `wait`), by polling `waitpid` for this PID
    only: asyncio's child watcher waits on the PIDs it spawned, never on these. Where it is not (or
    no longer) this process's child, it is gone once its PID no longer runs the process that had
    `start_ticks`, its status unknown (-1)."""

    UNKNOWN = -1

    def __init__(self, pid: int, start_ticks: int, poll_s: float = 0.05) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self._poll_s = poll_s
        self._returncode: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._returncode is None:
            self._returncode = self._poll()
        return self._returncode

    def _poll(self) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return None if read_start_ticks(self.pid) == self.start_ticks else self.UNKNOWN
        return os.waitstatus_to_exitcode(status) if pid else None

    async def wait(self) -> int:
        while self.returncode is None:  # noqa: ASYNC110 (no event tells a non-spawned child's exit)
            await asyncio.sleep(self._poll_s)
        return self._returncode


def reap_orphans(proc: Path = Path("/proc")) -> list[int]:
    """Reap the zombie children that were orphaned into this process (a child subreaper: see
    `warm_pool.succession`) and that no one else here waits for: members of another process's
    group, such as an engine's own children, left when that engine's group was stopped. A child
    this process spawned leads its own group (engines, runtimes, successors: each a session) or
    shares this process's, and is never touched here: its spawner waits for its status. The PIDs
    reaped."""
    own_group, reaped = os.getpgid(0), []
    try:
        tasks = list((proc / "self" / "task").iterdir())
    except OSError:
        return reaped
    for task in tasks:
        try:
            children = [int(pid) for pid in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in children:
            try:
                stat = (proc / str(pid) / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, …
            if fields[0] == "Z" and int(fields[2]) not in (pid, own_group):
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        reaped.append(pid)
    return reaped
