"""The arrival log: when each request came and how many tokens it took, for what-if replays.

Always on in `stoker up`: one JSON line per inference request that reached a deployment, written
when its answer ends, holding no content and no key:

    {"t": 1764568800.125, "deployment": "chat", "revision": 2, "in": 41, "out": 128, "status": 200}

`t` is the arrival (epoch seconds), `in`/`out` the tokens the answer reported (`stoker.control.cost`
counts the same). The file is `$STOKER_HOME/arrivals/arrivals.jsonl`, opened without following
links, mode 0600, one `write` per line; past `MAX_BYTES` (8 MiB, about 80,000 requests) it is
renamed `arrivals.jsonl.1`, replacing the one before: at most 16 MiB on disk. Lines are in order
of their answers' ends; the reader sorts them by arrival.

`stoker simulate --from-log FILE` replays it (`load_arrivals`: a `warm_pool.trace` trace).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from pathlib import Path

from warm_pool.trace import TraceError, TraceRequest

log = logging.getLogger("stoker.arrival_log")

LOG_DIR = "arrivals"
LOG_FILE = "arrivals.jsonl"
MAX_BYTES = 8 << 20


class ArrivalLog:
    """The JSONL file, appended a line a request, rotated by size (see the module)."""

    def __init__(self, dir: Path, max_bytes: int = MAX_BYTES) -> None:
        self.dir = dir
        self.path = dir / LOG_FILE
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._size = 0
        self._failed = False

    def write(
        self, t: float, deployment: str, revision: int, tokens_in: int, tokens_out: int, status: int
    ) -> None:
        """One arrival; a failure (a full disk) is logged once, never the request's."""
        record = {"t": round(t, 3), "deployment": deployment, "revision": revision}
        record |= {"in": tokens_in, "out": tokens_out, "status": status}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            if self._size and self._size + len(line) > self.max_bytes:
                self.close()
                os.replace(self.path, self.dir / f"{LOG_FILE}.1")
            if self._fd is None:
                self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                self._fd = os.open(self.path, flags, 0o600)
                self._size = os.fstat(self._fd).st_size
            os.write(self._fd, line)
            self._size += len(line)
        except OSError:
            if not self._failed:
                log.exception("could not write the arrival log %s", self.path)
                self._failed = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def load_arrivals(path: Path, deployment: str | None = None) -> tuple[TraceRequest, ...]:
    """The log's requests (of `deployment`, if given) as a trace: times from the first arrival,
    tokens in and out. A bad line is a `TraceError` naming the file and line."""
    try:
        before = os.lstat(path)
        if stat.S_ISLNK(before.st_mode) or not stat.S_ISREG(before.st_mode):
            raise TraceError(f"arrival log {path}: not a regular file (links are not followed)")
        f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
    except FileNotFoundError:
        raise TraceError(f"arrival log {path}: no such file") from None
    except OSError as exc:
        raise TraceError(f"arrival log {path}: cannot read it: {exc.strerror or exc}") from None
    rows: list[tuple[float, int, int]] = []
    names: set[str] = set()
    with f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            t, name, tokens_in, tokens_out = _line(path, number, raw)
            names.add(name)
            if deployment is None or name == deployment:
                rows.append((t, tokens_in, tokens_out))
    if not rows:
        seen = f" (it has {', '.join(sorted(names))})" if names else ""
        what = f"no requests of {deployment!r}{seen}" if deployment else "no requests in it"
        raise TraceError(f"arrival log {path}: {what}")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return tuple(TraceRequest(t - t0, tokens_in, tokens_out) for t, tokens_in, tokens_out in rows)


def _line(path: Path, number: int, raw: bytes) -> tuple[float, str, int, int]:
    where = f"arrival log {path} line {number}"
    try:
        record = json.loads(raw)
    except ValueError:
        raise TraceError(f"{where}: not JSON") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: not a JSON object")
    t, name = record.get("t"), record.get("deployment")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise TraceError(f"{where}: bad t {t!r} (want epoch seconds)")
    if not isinstance(name, str) or not name:
        raise TraceError(f"{where}: bad deployment {name!r}")
    counts = []
    for key in ("in", "out"):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: bad {key} {value!r} (want a whole number ≥ 0)")
        counts.append(value)
    return float(t), name, counts[0], counts[1]
