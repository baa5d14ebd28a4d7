"""Local processes, named so that a recycled PID is never mistaken for ours."""

from __future__ import annotations

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
