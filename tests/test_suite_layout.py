"""The suite's own layout: tests/platform mirrors platform/stoker's role folders, and every file the
scheduler is told to start first (`SLOW_FILES`) exists."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO, SLOW_FILES


def test_every_slow_file_exists() -> None:
    assert [f for f in SLOW_FILES if not (REPO / f).is_file()] == []


def test_tests_mirror_the_role_folders() -> None:
    roles = {p.name for p in (REPO / "platform" / "stoker").iterdir() if (p / "__init__.py").exists()}
    tested = {p.name for p in (REPO / "tests" / "platform").iterdir() if (p / "__init__.py").exists()}
    assert tested <= roles, f"test folders with no package to mirror: {sorted(tested - roles)}"
    flat = sorted(p.name for p in Path(REPO / "tests" / "platform").glob("test_*.py"))
    assert flat == [], f"tests/platform/ files outside a role folder: {flat}"
