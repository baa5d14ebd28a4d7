"""Helpers for the process tests: is a PID gone, and small scripts to run as real processes."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.deadlines import deadline


def pid_gone(pid: int) -> bool:
    """No process runs under `pid`: none at all, or only a zombie awaiting its (new) parent's reap."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone between the open and the read: ESRCH
        return True
    return stat[stat.rindex(")") + 2] == "Z"


async def wait_gone(pid: int, within_s: float = deadline(5)) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not pid_gone(pid):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _child_pid(log: Path) -> int | None:
    lines = log.read_text().splitlines() if log.exists() else []
    return next((int(line.split()[1]) for line in lines if line.startswith("child ")), None)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log yet)"


async def read_pid_line(log: Path, within_s: float = deadline(10)) -> int:
    """The PID a script printed as `child <pid>` into its log."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        if (pid := _child_pid(log)) is not None:
            return pid
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no 'child <pid>' line in {log} within {within_s:g} s; it holds:\n{_tail(log)}")


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


SLEEPER = "import time; time.sleep(60)"
# Ignores SIGTERM (its child inherits that), starts a child, prints the child's PID, sleeps.
STUBBORN_WITH_CHILD = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    f"c = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
    "print('child', c.pid, flush=True)\n"
    "time.sleep(60)\n"
)
