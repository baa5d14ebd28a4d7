"""Fixtures for the snapshot tests: a private store per test, and the real CLI as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from snapshots import SnapshotStore
from tests.deadlines import deadline
from tests.snapshots.support import RunCLI


@pytest.fixture
def home_env(stoker_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The shared test environment with a STOKER_HOME of this test's own, and no snapshot budget."""
    env = {**stoker_env, "STOKER_HOME": str(tmp_path / "stoker-home")}
    env.pop("STOKER_SNAPSHOT_BUDGET", None)
    return env


@pytest.fixture
def store_root(home_env: dict[str, str]) -> Path:
    return Path(home_env["STOKER_HOME"]) / "snapshots"


@pytest.fixture
def store(store_root: Path) -> SnapshotStore:
    return SnapshotStore(store_root)


@pytest.fixture
def cli(home_env: dict[str, str]) -> RunCLI:
    """Run `stoker snapshot ARGS...` against this test's STOKER_HOME."""

    def run(*args: str, timeout: float = deadline(120)) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "stoker.cli.main", "snapshot", *args],
            env=home_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run
