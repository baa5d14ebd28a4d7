"""`stoker.control.checkpoint`: the file store (round trip, mode, every refusal, the size bound, a
crash mid-write leaving the old checkpoint whole) and `Checkpoints` restoring real sources, with one
warning for a refused checkpoint and a clean start, never half of one."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from stoker.control.checkpoint import (
    FORMAT,
    MAX_BYTES,
    CheckpointRefused,
    Checkpoints,
    FileCheckpointStore,
    interval_error,
)
from stoker.control.cost import CostMeter
from stoker.control.history import HistoryConfig, HistorySampler
from stoker.control.prices import PriceTable
from tests.deadlines import deadline

BODY = {"figures": [1, 2.5, None], "name": "chat"}


def store(tmp_path: Path, **kw) -> FileCheckpointStore:
    return FileCheckpointStore(tmp_path / "checkpoints", wall=lambda: 1_764_568_800.0, **kw)


def test_a_checkpoint_round_trips_in_a_0600_file_in_a_0700_dir(tmp_path):
    s = store(tmp_path)
    assert s.read("cost") is None  # none yet: a first start
    s.write("cost", BODY)
    assert s.read("cost") == BODY
    path = tmp_path / "checkpoints" / "cost.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    doc = json.loads(path.read_text())
    assert doc == {"format": FORMAT, "kind": "cost", "written_at": 1_764_568_800.0, "body": BODY}
    s.write("cost", {"figures": []})  # replaced whole
    assert s.read("cost") == {"figures": []}
    assert sorted(p.name for p in path.parent.iterdir()) == ["cost.json"]  # no temp file left


def _valid(kind: str = "cost", **envelope) -> bytes:
    return json.dumps({"format": FORMAT, "kind": kind, "written_at": 1.0, "body": BODY} | envelope).encode()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x00\xffnot json", "not JSON (truncated or corrupt)"),
        (_valid()[: len(_valid()) // 2], "not JSON (truncated or corrupt)"),
        (b"", "not JSON (truncated or corrupt)"),
        (b"[1, 2]", "not a checkpoint (want an object of format, kind, written_at, body)"),
        (json.dumps({"format": 1, "kind": "cost", "body": {}}).encode(), "not a checkpoint"),
        (_valid(format=2), "format 2, and this version reads format 1"),
        (_valid(format="1"), "bad format '1'"),
        (_valid("history"), "a checkpoint of 'history', not of 'cost'"),
        (_valid(written_at=None), "bad written_at None"),
        (_valid(body=[1]), "its body is not an object"),
        (_valid().replace(b"2.5", b"NaN"), "not JSON"),
        (_valid().replace(b"2.5", b"Infinity"), "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    ],
    ids=[
        "corrupt",
        "truncated",
        "empty",
        "a-list",
        "no-written-at",
        "another-format",
        "format-as-text",
        "another-kind",
        "bad-written-at",
        "body-not-object",
        "nan",
        "infinity",
        "nested-deep",
    ],
)
def test_a_checkpoint_that_cannot_be_trusted_is_refused_saying_why(tmp_path, data, why):
    s = store(tmp_path)
    s.dir.mkdir(mode=0o700)
    (s.dir / "cost.json").write_bytes(data)
    with pytest.raises(CheckpointRefused) as err:
        s.read("cost")
    assert why in str(err.value)


def test_an_oversized_checkpoint_is_neither_read_nor_written(tmp_path):
    s = store(tmp_path, max_bytes=4096)
    s.write("cost", BODY)
    with pytest.raises(
        CheckpointRefused, match=r"bytes, over the bound of 4096: not written \(the previous one stays\)"
    ):
        s.write("cost", {"figures": [0.5] * 2000})
    assert s.read("cost") == BODY  # the previous one stays
    (s.dir / "cost.json").write_bytes(_valid()[:-1] + b" " * 5000 + b"}")  # valid JSON, too large
    with pytest.raises(CheckpointRefused, match=r"\d+ bytes, over the bound of 4096"):
        s.read("cost")
    assert MAX_BYTES == 16 << 20


def test_links_are_never_followed(tmp_path):
    s = store(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(_valid())
    s.dir.mkdir(mode=0o700)
    (s.dir / "cost.json").symlink_to(elsewhere)
    with pytest.raises(CheckpointRefused, match="it is a symbolic link"):
        s.read("cost")
    s.write("cost", {"mine": 1})  # the link itself is replaced, its target untouched
    assert not (s.dir / "cost.json").is_symlink() and elsewhere.read_bytes() == _valid()
    # A linked directory: neither read nor written through.
    real = tmp_path / "real"
    real.mkdir()
    linked = FileCheckpointStore(tmp_path / "linked")
    (tmp_path / "linked").symlink_to(real, target_is_directory=True)
    with pytest.raises(CheckpointRefused, match="is a symbolic link"):
        linked.read("cost")
    with pytest.raises(CheckpointRefused, match="is a symbolic link"):
        linked.write("cost", BODY)
    assert list(real.iterdir()) == []


def test_something_that_is_not_a_regular_file_is_refused(tmp_path):
    s = store(tmp_path)
    s.dir.mkdir(mode=0o700)
    os.mkfifo(s.dir / "cost.json")  # opened without blocking, then refused
    with pytest.raises(CheckpointRefused, match="not a regular file"):
        s.read("cost")


# A real process that dies while writing (os._exit: no cleanup, no finally), at two points: half
# the bytes written, and the whole temp file written but not yet renamed over the old one.
CRASH = """
import os, sys
from pathlib import Path
from stoker.control.checkpoint import FileCheckpointStore

class HalfThenDie:
    def __init__(self, fd):
        self.fd = fd
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
    def write(self, data):
        os.write(self.fd, bytes(data)[: len(data) // 2])
        os._exit(9)

if sys.argv[2] == "mid-write":
    os.fdopen = lambda fd, mode: HalfThenDie(fd)
else:
    os.replace = lambda *args: os._exit(9)
FileCheckpointStore(Path(sys.argv[1])).write("cost", {"new": list(range(1000))})
"""


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_a_crash_mid_write_leaves_the_old_checkpoint(tmp_path, where):
    s = store(tmp_path)
    s.write("cost", BODY)
    result = subprocess.run(
        [sys.executable, "-c", CRASH, str(s.dir), where], capture_output=True, text=True, timeout=deadline(60)
    )
    assert result.returncode == 9, result.stderr
    left = [p.name for p in s.dir.iterdir() if p.name != "cost.json"]
    assert len(left) == 1 and left[0].startswith(".cost.json.tmp-")  # what the dead writer left
    assert s.read("cost") == BODY  # the old checkpoint, whole
    store(tmp_path).write("cost", {"after": 1})  # the next run's first write sweeps the leftover
    assert sorted(p.name for p in s.dir.iterdir()) == ["cost.json"]


def test_the_interval_is_bounded():
    assert interval_error(30.0) is None
    assert interval_error(0.5) == "must be 1s to 3600s (or off), got 0.5s"
    assert interval_error(7200.0) is not None
    with pytest.raises(ValueError, match="checkpoint interval must be 1s"):
        Checkpoints(store(Path("/nonexistent")), [], 0.1)


# ---- Checkpoints, with the real sources ---------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def meter(clock: Clock, wall: Clock) -> CostMeter:
    return CostMeter(PriceTable.parse({"ready_hour": 3.6}), CollectorRegistry(), clock, wall=wall)


def sampler(clock: Clock, wall: Clock) -> HistorySampler:
    return HistorySampler(CollectorRegistry(), HistoryConfig(interval_s=5), clock=clock, wall=wall)


def test_every_source_comes_back_and_a_refused_one_starts_clean_with_one_warning(tmp_path, caplog):
    clock, wall = Clock(100.0), Clock(1_764_568_800.0)
    cost, history = meter(clock, wall), sampler(clock, wall)
    cost.instance_seconds("chat", 1, "cpu", "READY", 10.0)
    cost.record("chat", 1, wall.now, 5, 7, 200)
    history.history.restore([{"t": wall.now - 10, "dt": 5.0, "deployments": {}}])
    s = store(tmp_path)
    checkpoints = Checkpoints(s, [cost, history], 30.0)
    asyncio.run(checkpoints.write())
    assert sorted(p.name for p in s.dir.iterdir()) == ["cost.json", "history.json"]

    again_cost, again_history = meter(clock, wall), sampler(clock, wall)
    (s.dir / "history.json").write_bytes((s.dir / "history.json").read_bytes()[:20])  # truncated
    caplog.set_level(logging.INFO, logger="stoker.checkpoint")
    asyncio.run(Checkpoints(s, [again_cost, again_history], 30.0).restore())
    assert again_cost.report() == cost.report()
    assert again_history.history.snapshot()["points"] == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"checkpoint {s.dir / 'history.json'} refused: not JSON (truncated or corrupt); history starts clean"
    ]


def test_a_body_with_one_bad_field_restores_nothing_of_it(tmp_path, caplog):
    clock, wall = Clock(100.0), Clock(1_764_568_800.0)
    cost = meter(clock, wall)
    for name in ("alpha", "beta", "gamma"):
        cost.instance_seconds(name, 1, "cpu", "READY", 10.0)
    body = cost.checkpoint()
    body["revisions"][1]["ledger"]["total"]["s:READY"] = -5.0  # one field, in the middle
    s = store(tmp_path)
    s.write("cost", body)
    again = meter(clock, wall)
    asyncio.run(Checkpoints(s, [again], 30.0).restore())
    assert again.report() == []  # not alpha alone: all or nothing
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "cost.revisions[1].ledger.total.s:READY: want a number ≥ 0, got -5.0" in warning


def test_a_write_that_fails_is_logged_once_until_one_succeeds(tmp_path, caplog):
    clock, wall = Clock(), Clock(1_764_568_800.0)
    cost = meter(clock, wall)
    s = store(tmp_path, max_bytes=300)
    for name in ("alpha", "beta", "gamma"):
        cost.instance_seconds(name, 1, "cpu", "READY", 10.0)
    checkpoints = Checkpoints(s, [cost], 30.0)
    asyncio.run(checkpoints.write())
    asyncio.run(checkpoints.write())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "over the bound of 300: not written" in warnings[0]
    assert not (s.dir / "cost.json").exists()


async def test_the_periodic_writes_stop_without_cutting_one_short(tmp_path):
    clock, wall = Clock(), Clock(1_764_568_800.0)
    cost = meter(clock, wall)
    cost.instance_seconds("chat", 1, "cpu", "READY", 1.0)
    s = store(tmp_path)
    checkpoints = Checkpoints(s, [cost], 1.0)
    checkpoints.start()
    await checkpoints.stop()  # before the first interval: nothing written, the loop gone
    assert not (s.dir / "cost.json").exists()
    await checkpoints.write()  # the shutdown's own
    assert s.read("cost") == cost.checkpoint()
