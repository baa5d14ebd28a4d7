"""Byte counts as people write them (`50G`, `512MiB`, `1.5 GB`) and as the store prints them.

The units follow GNU coreutils (`dd`, `du`, `sort -h`), which is what an operator sizing a disk
budget reaches for: a bare `K`/`M`/`G`/`T` and the `KiB`/`Ki` forms are powers of 1024, the `KB`
forms powers of 1000. So `50G` is 50 x 2**30 bytes and `50GB` is 50 x 10**9.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def _multiplier(unit: str) -> int | None:
    upper = unit.upper()
    if upper in ("", "B"):
        return 1
    prefix, rest = upper[0], upper[1:]
    if prefix not in _POWERS:
        return None
    if rest in ("", "I", "IB"):
        return 1024 ** _POWERS[prefix]
    if rest == "B":
        return 1000 ** _POWERS[prefix]
    return None


def parse_size(text: str) -> int:
    """The number of bytes `text` spells: `1048576`, `512KiB`, `50G`, `1.5GB`; ValueError otherwise."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    multiplier = _multiplier(match.group(2)) if match else None
    if match is None or multiplier is None:
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with a unit such as 512MiB, 50G or 20GB "
            "(K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000)"
        )
    return round(float(match.group(1)) * multiplier)


def format_size(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps the number at or above 1: `512.0 MiB`."""
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path`, read without following links (a file gone meanwhile counts 0)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total
