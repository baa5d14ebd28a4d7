"""Helpers shared by the benchmark scripts in bench/ (engine_bench, scale_bench, proxy_bench).

Process control (every child in its own session, stopped as a group, SIGTERM'd if the benchmark
dies), free ports, the `stoker` command, logging to stderr, medians and ratios, rounding for the
JSON file, table formatting, and the machine description recorded with each result. The scripts
run as `python bench/X.py`, which puts bench/ on sys.path, so they import this as `common`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- processes ---------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if this benchmark dies without cleaning up."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Processes:
    """Every process this benchmark starts, each in its own session, so all can be stopped."""

    def __init__(self, stop_all_timeout: float = 10.0) -> None:
        self._live: list[subprocess.Popen] = []
        self.stop_all_timeout = stop_all_timeout

    def spawn(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent, **kwargs)
        self._live.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 15.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if proc in self._live:
            self._live.remove(proc)

    def live(self) -> list[subprocess.Popen]:
        return [p for p in self._live if p.poll() is None]

    def stop_all(self) -> None:
        for proc in list(self._live):
            self.stop(proc, timeout=self.stop_all_timeout)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def stoker_command() -> list[str]:
    script = Path(sys.executable).parent / "stoker"
    return [str(script)] if script.exists() else [sys.executable, "-m", "stoker.cli.main"]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_json(cmd: list[str], env: dict[str, str], timeout: float = 600):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- figures -----------------------------------------------------------------------------------------


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def rnd(obj, digits: int = 4):
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rnd(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [rnd(v, digits) for v in obj]
    return obj


def fmt_s(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if abs(x) < 1 else f"{x:.2f} s"


def fmt_x(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}×"


# ---- the disk ----------------------------------------------------------------------------------------


def drop_page_cache(path: Path) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise_dontneed"


def dd_read(path: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=16M"], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    m = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", out.stderr)
    nbytes, seconds = (int(m.group(1)), float(m.group(2))) if m else (path.stat().st_size, wall)
    return {"seconds": seconds, "wall_s": wall, "bytes": nbytes}


# ---- the machine -------------------------------------------------------------------------------------


def machine_info(dists: Iterable[str] = (), *, mem_total: bool = False, **extra) -> dict:
    """CPUs, kernel, Python, the versions of `dists` (None if absent), then `extra`, git, load."""
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    info: dict = {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
    }
    if mem_total:
        mem = next(
            (
                int(ln.split()[1])
                for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")
            ),
            0,
        )
        info["mem_total_gib"] = round(mem / 2**20, 1)
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    return {
        **info,
        "kernel": platform.release(),
        "python": platform.python_version(),
        **{d: version(d) for d in dists},
        **extra,
        "git_commit": git.stdout.strip() or None,
        "git_dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None,
        "loadavg_start": os.getloadavg(),
    }


def write_results(out: Path, results: dict, md: str, digits: int = 4) -> None:
    """The results as JSON (floats rounded) at `out`, the table next to it (`.md`) and on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rnd(results, digits), indent=2) + "\n")
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    say(f"done in {results['elapsed_s']:.0f} s; wrote {out} and {out.with_suffix('.md')}")


# ---- the snapshot ------------------------------------------------------------------------------------


def import_builtin_snapshot(home: Path, name: str = "smollm2") -> dict:
    """`stoker snapshot import --builtin NAME --name NAME` into `home` (as `STOKER_HOME`): its record
    (`id`, `name`, `path`, `bytes`, `dtype`). The first import converts the GGUF (about half a minute);
    later ones find the snapshot in the store and return at once."""
    home.mkdir(parents=True, exist_ok=True)
    say(f"snapshot {name}: importing into {home} if missing (the first time converts the GGUF, ~1 min)")
    env = {**os.environ, "STOKER_HOME": str(home)}
    cmd = [*stoker_command(), "snapshot", "import", "--builtin", name, "--name", name, "--json"]
    return run_json(cmd, env)


# ---- the CPU, shared ---------------------------------------------------------------------------------


def _group_cpu_seconds(pgids: set[int]) -> float:
    """utime + stime + cutime + cstime of every live process in these process groups: a server's
    own children (vLLM's engine core and workers) count while they run, and through their parent's
    cutime once it has reaped them."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            f = stat.read_text().rsplit(")", 1)[1].split()
            if int(f[2]) in pgids:  # field 5, pgrp
                total += sum(int(x) for x in f[11:15])
    return total / CLK_TCK


class CpuShare:
    """CPU used during each named section by this benchmark's process groups and by everything else.

    others = all busy CPU time (/proc/stat) − ours (this process, its reaped children, and every
    live process in the groups it started, grandchildren included); in cores, averaged over the
    section. Another workload on this shared machine shows up there, and so does hypervisor steal.
    """

    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.sections: dict[str, dict] = {}

    def _sample(self) -> tuple[float, float, float, float]:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = v
        t = os.times()
        ours = t.user + t.system + t.children_user + t.children_system
        ours += _group_cpu_seconds({p.pid for p in self.procs.live()})  # each spawned in its own group
        return time.perf_counter(), (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK, ours

    @contextlib.contextmanager
    def section(self, name: str):
        t0, busy0, steal0, ours0 = self._sample()
        try:
            yield
        finally:
            t1, busy1, steal1, ours1 = self._sample()
            wall = max(t1 - t0, 1e-9)
            self.sections[name] = {
                "wall_s": wall,
                "busy_cores": (busy1 - busy0) / wall,
                "ours_cores": (ours1 - ours0) / wall,
                "others_cores": max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall,
                "steal_cores": (steal1 - steal0) / wall,
                "loadavg_1m_end": os.getloadavg()[0],
            }
