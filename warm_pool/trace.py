"""Request traces for the simulator: CSV files with TIMESTAMP, ContextTokens, GeneratedTokens.

The format of the Azure LLM inference traces (../shared/traces): TIMESTAMP is a date and time
("2023-11-16 18:17:03.9799600", any number of fractional digits) or plain seconds ("12.5").
Times are made relative to the first request. `thin=K` keeps every K-th request (a low-traffic
endpoint with the same shape); `time_scale=S` multiplies every time (S > 1 stretches, S < 1
compresses). A bad file, a missing column or a bad value is a `TraceError` naming file and line.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
import re
from dataclasses import dataclass
from pathlib import Path

from warm_pool.errors import PoolError

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_DATETIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?")
_EPOCH = dt.datetime(1970, 1, 1)


class TraceError(PoolError):
    """A trace file that cannot be read, or a row in it that makes no sense."""


@dataclass(frozen=True)
class TraceRequest:
    t: float  # seconds after the trace's first request
    context_tokens: int
    generated_tokens: int


def load_trace(path: str | Path, *, thin: int = 1, time_scale: float = 1.0) -> tuple[TraceRequest, ...]:
    """The trace's requests in time order, thinned and scaled."""
    path = Path(path)
    if not isinstance(thin, int) or thin < 1:
        raise TraceError(f"--thin must be a whole number ≥ 1, got {thin!r}")
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise TraceError(f"--time-scale must be a number > 0, got {time_scale!r}")
    try:
        with path.open(newline="") as f:
            rows = list(_rows(path, f))
    except FileNotFoundError:
        raise TraceError(f"trace {path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"trace {path}: is a directory, not a CSV file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"trace {path}: cannot read it: {exc}") from None
    if not rows:
        raise TraceError(f"trace {path}: no requests in it")
    rows.sort(key=lambda r: r[0])  # stable: equal times keep file order
    kept = rows[::thin]
    t0 = kept[0][0]
    return tuple(TraceRequest((t - t0) * time_scale, ctx, gen) for t, ctx, gen in kept)


def _rows(path: Path, f):
    reader = csv.DictReader(f)
    header = [h.strip() for h in reader.fieldnames or []]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        found = ", ".join(header) if header else "nothing"
        raise TraceError(
            f"trace {path}: missing column {missing[0]} (found: {found}; need {', '.join(COLUMNS)})"
        )
    reader.fieldnames = header
    for row in reader:
        line = reader.line_num
        if not any((v or "").strip() for v in row.values()):
            continue
        yield (
            _time(path, line, row["TIMESTAMP"]),
            _count(path, line, "ContextTokens", row["ContextTokens"]),
            _count(path, line, "GeneratedTokens", row["GeneratedTokens"]),
        )


def _time(path: Path, line: int, raw: str | None) -> float:
    text = (raw or "").strip()
    m = _DATETIME.fullmatch(text)
    if m:
        y, mo, d, h, mi, s, frac = m.groups()
        try:
            when = dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s))
        except ValueError:
            raise TraceError(f"trace {path} line {line}: bad TIMESTAMP {text!r}") from None
        return (when - _EPOCH).total_seconds() + (float(f"0.{frac}") if frac else 0.0)
    try:
        value = float(text)
    except ValueError:
        raise TraceError(
            f"trace {path} line {line}: bad TIMESTAMP {text!r} (want 'YYYY-MM-DD HH:MM:SS.fff' or seconds)"
        ) from None
    if not math.isfinite(value):
        raise TraceError(f"trace {path} line {line}: bad TIMESTAMP {text!r}")
    return value


def _count(path: Path, line: int, column: str, raw: str | None) -> int:
    text = (raw or "").strip()
    try:
        value = int(text)
    except ValueError:
        raise TraceError(
            f"trace {path} line {line}: bad {column} {text!r} (want a whole number ≥ 0)"
        ) from None
    if value < 0:
        raise TraceError(f"trace {path} line {line}: bad {column} {text!r} (want a whole number ≥ 0)")
    return value
