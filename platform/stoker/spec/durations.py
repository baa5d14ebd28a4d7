"""Durations as people write them, wherever the CLI takes seconds.

    90, 1.5        seconds
    90s, 500ms     seconds, milliseconds
    5m, 1h, 2d     minutes, hours, days
    1h30m, 1m30s   parts added up, largest unit first, each unit at most once

Go's `time.ParseDuration` and kubectl read the same forms (days added: idle timeouts run to a
week). Negative, infinite and empty values are refused with one line that says what is taken.
"""

from __future__ import annotations

import argparse
import math
import re

UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|d|h|m|s)")
_ORDER = list(UNITS)


def parse_duration(text: str) -> float:
    """Seconds in `text`; ValueError (one line, quoting it) if it is not a duration."""
    spelled = text.strip().lower()
    try:
        seconds = float(spelled)
    except ValueError:
        seconds = _parts(spelled, text)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(_bad(text))
    return seconds


def _parts(spelled: str, text: str) -> float:
    total, at, last = 0.0, 0, -1
    for match in _PART.finditer(spelled):
        rank = _ORDER.index(match.group(2))
        if match.start() != at or rank <= last:  # a gap, a repeat, or units out of order
            raise ValueError(_bad(text))
        total += float(match.group(1)) * UNITS[match.group(2)]
        at, last = match.end(), rank
    if at == 0 or at != len(spelled):
        raise ValueError(_bad(text))
    return total


def _bad(text: str) -> str:
    return f"{text!r} is not a duration: give seconds (90) or a number and unit, e.g. 90s, 5m, 1h, 1h30m"


def duration(text: str) -> float:
    """argparse `type=`: a bad value is argparse's one-line error, naming the flag."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_duration(seconds: float) -> str:
    """The shortest spelling `parse_duration` reads back: 300 → "5m", 5400 → "1h30m", 0.5 → "0.5s"."""
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"not a duration: {seconds!r}")
    if seconds != int(seconds) or seconds == 0:
        return f"{seconds:g}s"
    left, out = int(seconds), []
    for unit in ("d", "h", "m", "s"):
        n, left = divmod(left, int(UNITS[unit]))
        if n:
            out.append(f"{n}{unit}")
    return "".join(out)
