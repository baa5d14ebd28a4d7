"""Processes a test session started and did not stop: found at its end, named, and killed.

Every process the suite starts (platforms, controllers, gateways, engines, warm runtimes, vLLM,
moto, CLI runs) carries the session's temporary directory in its command line or its environment
(`STOKER_HOME`, a snapshot under it, an engine's owner mark naming its data dir). A fixture stops
what it started, also when its test fails; this sweep is the net under that: at the end of the
session (of each worker) what is still running with the directory in it is SIGTERMed, then
SIGKILLed, and listed in the summary, so that a fixture that leaks is seen and fixed rather than
leaving engines running on a shared machine after the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

GRACE_S = 5.0  # between the SIGTERM and the SIGKILL


def _mine(pid: int, marker: bytes) -> bool:
    proc = Path(f"/proc/{pid}")
    try:
        if proc.stat().st_uid != os.getuid():
            return False
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return False
        return marker in (proc / "cmdline").read_bytes() or marker in (proc / "environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def ancestors() -> set[int]:
    """This process and its parents: never strays, whatever their environment holds."""
    found, pid = set(), os.getpid()
    while pid > 1:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            break
    return found


def strays(base: Path) -> dict[int, str]:
    """pid -> command line, for the live processes that name `base` (but this one and its parents)."""
    marker, keep = str(base).encode(), ancestors()
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid not in keep and _mine(pid, marker):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                out[pid] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    return out


def sweep(base: Path) -> dict[int, str]:
    """SIGTERM every stray, SIGKILL those still alive after `GRACE_S`; what was found."""
    found = strays(base)
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)  # one left stopped answers SIGTERM only once continued
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    while time.monotonic() < end and strays(base):
        time.sleep(0.1)
    for pid in strays(base):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return found
