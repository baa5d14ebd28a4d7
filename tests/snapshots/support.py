"""Assertions shared by the snapshot tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

RunCLI = Callable[..., subprocess.CompletedProcess]  # the `cli` fixture: runs `stoker snapshot ARGS...`


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """The CLI's contract for user errors: exit 1, one line on stderr, no traceback."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("stoker: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# The store's bookkeeping beside the snapshots: index dirs, and the lock taken while evicting.
BOOKKEEPING = ("names", "sources", "remotes", "used", "pins", "verified", ".lock")


def snapshot_dirs(root: Path) -> list[str]:
    """Every entry of the store root except its bookkeeping (so temp, pull and trash dirs show up)."""
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name not in BOOKKEEPING)
