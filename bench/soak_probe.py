"""What the soak benchmark (bench/soak.py) samples of the platform's processes, and the line it fits.

A sample walks /proc once: the processes under `stoker up` (its descendants by parent pid), every
process in its session (`stoker up` is started in a session of its own; engines and warm runtimes
start sessions of their own), and which of the processes ever seen in the tree still run outside
it (`escaped`: re-parented to init while the platform runs, which nothing should be). For the tree: the
process count, open file descriptors (entries of /proc/PID/fd), resident and proportional set size
(VmRSS from /proc/PID/status, Pss from /proc/PID/smaps_rollup) of `stoker up` itself and summed
over the tree. A process that exits while it is read is skipped.

`fit` is an ordinary least-squares line through (hours, value): its slope per hour, the standard
error of that slope, and the first, last, lowest and highest values.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, session id, start time in clock ticks) of `pid`, None if it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3]), int(fields[19])


def _kib(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in path.read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(PROC / str(pid) / "fd"))
    except OSError:
        return 0


def processes() -> dict[int, tuple[int, int, int]]:
    """Every live process: pid -> (ppid, sid, starttime)."""
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            out[int(entry.name)] = st
    return out


def tree(root: int, table: dict[int, tuple[int, int, int]]) -> list[int]:
    """`root` and its descendants (by parent pid), root first."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _sid, _start) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root] if root in table else []
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def sample(root: int, seen: set[tuple[int, int]]) -> dict:
    """One reading of the platform's processes (see the module's docstring); sizes in MiB. `seen`,
    the (pid, start time) of every process met in the tree so far, is updated."""
    table = processes()
    pids = tree(root, table)
    session = [pid for pid, (_ppid, sid, _start) in table.items() if sid == root]
    seen.update((pid, table[pid][2]) for pid in pids)
    escaped = sorted(
        pid for pid, start in seen if pid not in pids and pid in table and table[pid][2] == start
    )
    rss = {pid: _kib(PROC / str(pid) / "status", "VmRSS:") for pid in pids}
    pss = {pid: _kib(PROC / str(pid) / "smaps_rollup", "Pss:") for pid in pids}
    fds = {pid: _fds(pid) for pid in pids}
    return {
        "procs": len(pids),
        "session_procs": len(session),
        "escaped": escaped,
        "fds_up": fds.get(root, 0),
        "fds_tree": sum(fds.values()),
        "rss_up_mib": rss.get(root, 0) / 1024,
        "pss_up_mib": pss.get(root, 0) / 1024,
        "rss_tree_mib": sum(rss.values()) / 1024,
        "pss_tree_mib": sum(pss.values()) / 1024,
    }


def members(root: int) -> set[tuple[int, int]]:
    """(pid, starttime) of `root`'s tree and session: which of them still run later is `alive`'s job."""
    table = processes()
    pids = set(tree(root, table)) | {pid for pid, (_p, sid, _s) in table.items() if sid == root}
    return {(pid, table[pid][2]) for pid in pids}


def alive(procs: set[tuple[int, int]]) -> list[int]:
    """The pids of `procs` still running (the same process: same pid and start time)."""
    return sorted(pid for pid, start in procs if (st := _stat(pid)) is not None and st[2] == start)


def fit(hours: list[float], values: list[float]) -> dict:
    """Least-squares slope per hour (and its standard error) with first/last/min/max of `values`."""
    out: dict = {"n": len(values)}
    if not values:
        return out
    out.update(first=values[0], last=values[-1], min=min(values), max=max(values))
    if len(values) < 3 or max(hours) - min(hours) <= 0:
        return out
    slope, intercept = statistics.linear_regression(hours, values)
    mean_h = statistics.fmean(hours)
    residual = sum((v - (slope * h + intercept)) ** 2 for h, v in zip(hours, values, strict=True))
    spread = sum((h - mean_h) ** 2 for h in hours)
    out["slope_per_h"] = slope
    out["slope_se_per_h"] = math.sqrt(residual / (len(values) - 2) / spread) if spread else None
    return out
