"""Records of live instances on disk, and what a restarted platform does with them: a recorded
engine that still runs is handed over for adoption, the rest is cleaned up."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.warm_pool.rig import at
from warm_pool.backends.local import LocalBackend
from warm_pool.backends.procs import read_start_ticks
from warm_pool.backends.records import InstanceRecord, InstanceRecords, marked
from warm_pool.launch import LaunchSpec

from .support import SLEEPER, pid_gone, python, wait_gone

if sys.platform != "linux":  # pragma: no cover
    pytest.skip("records carry Linux start times from /proc", allow_module_level=True)

# Starts a sleeper in its own session and exits: the sleeper is an orphan, as an engine is once the
# platform that started it has died. The sleeper writes its PID to argv[2] once it is set up; with
# argv[1] == "1" it ignores SIGTERM first.
ORPHAN = (
    "import os, signal, sys, time\n"
    "if sys.argv[1] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "open(sys.argv[2] + '.tmp', 'w').write(str(os.getpid())); os.rename(sys.argv[2] + '.tmp', sys.argv[2])\n"
    "time.sleep(60)\n"
)
ORPHAN_MAKER = (
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]], start_new_session=True,\n"
    "                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
)


def record(id: str, pid: int, start_ticks: int, port: int = 40000, secret: str = "k") -> InstanceRecord:
    deployment = id.rsplit("-", 1)[0]
    return InstanceRecord(
        id, deployment, pid, pid, start_ticks, port, f"http://127.0.0.1:{port}", 1.7e9, "snap", secret
    )


def _read_pid(pid_file: Path) -> int | None:
    return int(pid_file.read_text()) if pid_file.exists() else None


async def make_orphan(pid_file: Path, ignore_term: bool) -> int:
    maker = await asyncio.create_subprocess_exec(
        *python(ORPHAN_MAKER), ORPHAN, "1" if ignore_term else "0", str(pid_file)
    )
    assert await maker.wait() == 0
    for _ in range(500):
        if (pid := _read_pid(pid_file)) is not None:
            return pid
        await asyncio.sleep(0.02)
    raise TimeoutError("the orphan never wrote its PID")


def test_put_all_remove(tmp_path):
    records = InstanceRecords(tmp_path / "instances")
    assert records.all() == []
    a, b = record("m-0000000a", 111, 5), record("m-0000000b", 222, 6)
    records.put(b)
    records.put(a)
    records.put(a)  # rewriting is fine
    assert records.all() == [a, b]
    assert sorted(p.name for p in (tmp_path / "instances").iterdir()) == [
        "m-0000000a.json",
        "m-0000000b.json",
    ]
    assert json.loads((tmp_path / "instances" / "m-0000000a.json").read_text())["start_ticks"] == 5
    records.remove("m-0000000a")
    records.remove("m-0000000a")  # twice is fine
    assert records.all() == [b]


def test_unreadable_records_are_skipped_and_bad_ids_refused(tmp_path):
    records = InstanceRecords(tmp_path)
    records.put(record("m-1", 1, 1))
    (tmp_path / "torn.json").write_text('{"id": "torn"')
    (tmp_path / "other.json").write_text('{"id": "x"}')
    (tmp_path / ".m-2.json.tmp").write_text("half")  # a write that never finished
    assert [r.id for r in records.all()] == ["m-1"]
    for bad in ("../etc/passwd", "", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="instance id must be"):
            records.put(record(bad, 1, 1))


def test_records_hold_the_key_for_their_owner_only(tmp_path):
    records = InstanceRecords(tmp_path / "instances")
    records.put(record("m-1", 1, 1, secret="s3cret"))
    assert (tmp_path / "instances").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "instances" / "m-1.json").stat().st_mode & 0o777 == 0o600
    assert "s3cret" not in repr(records.all()[0])


async def test_a_recorded_engine_that_runs_is_handed_over_with_its_address_and_key(tmp_path):
    pid = await make_orphan(tmp_path / "orphan.pid", ignore_term=False)
    try:
        records = InstanceRecords(tmp_path / "instances")
        records.put(record("m-0a0a0a0a", pid, read_start_ticks(pid), port=41234, secret="key-a"))
        records.put(record("m-gone", 2**22 + 17, 1))  # a process that no longer exists
        [found] = await LocalBackend(tmp_path, records=records).running()
        assert (found.instance_id, found.deployment, found.snapshot_id) == ("m-0a0a0a0a", "m", "snap")
        assert (found.url, found.secret, found.handle.pid) == ("http://127.0.0.1:41234", "key-a", pid)
        assert [r.id for r in records.all()] == ["m-0a0a0a0a"]  # the dead one's record is gone
        backend = LocalBackend(tmp_path, records=records)
        await backend.running()
        await backend.stop(found.handle, 5)  # the adopter stops it as its own: record and process go
        assert await wait_gone(pid) and records.all() == []
    finally:
        if not pid_gone(pid):
            os.kill(pid, 9)


@pytest.mark.parametrize("ignore_term", [False, True], ids=["stops-on-sigterm", "needs-sigkill"])
async def test_a_recorded_engine_without_a_key_cannot_be_reached_and_is_stopped(tmp_path, ignore_term):
    pid = await make_orphan(tmp_path / "orphan.pid", ignore_term)
    try:
        records = InstanceRecords(tmp_path / "instances")
        records.put(record("m-0a0a0a0a", pid, read_start_ticks(pid), secret=""))  # from before keys
        assert await LocalBackend(tmp_path, records=records).running() == []
        assert await wait_gone(pid), f"orphan {pid} still runs"
        assert records.all() == []
    finally:
        if not pid_gone(pid):
            os.kill(pid, 9)


async def test_a_recycled_pid_is_left_alone_and_its_record_removed(tmp_path):
    # A record whose PID now names another process: a live one of ours, with other start ticks. (Not
    # this test's own PID: were the check broken, the stop would signal pytest's own process group.)
    backend = LocalBackend(tmp_path)
    bystander = await backend.start(at("bystander"), LaunchSpec(python(SLEEPER)))
    try:
        records = InstanceRecords(tmp_path / "instances")
        records.put(record("m-old", bystander.pid, bystander.start_ticks - 1))
        assert await LocalBackend(tmp_path, records=records).running() == []
        await asyncio.sleep(0.2)  # were a signal sent, it would have landed by now
        assert backend.is_alive(bystander)
        assert records.all() == []
    finally:
        await backend.stop(bystander, term_timeout_s=5)


async def test_an_engine_never_recorded_is_found_by_its_owner_mark_and_stopped(tmp_path):
    # A run killed between spawning an engine and writing its record: the engine carries its owner.
    first = LocalBackend(tmp_path / "logs", owner=str(tmp_path))
    unrecorded = await first.start(at("m-0b0b0b0b"), LaunchSpec(python(SLEEPER)))
    other = LocalBackend(tmp_path / "logs", owner=str(tmp_path / "another-data-dir"))
    bystander = await other.start(at("m-other"), LaunchSpec(python(SLEEPER)))
    try:
        assert [h.pid for h in marked(str(tmp_path))] == [unrecorded.pid]
        records = InstanceRecords(tmp_path / "instances")
        again = LocalBackend(tmp_path / "logs", owner=str(tmp_path), records=records)
        assert await again.running() == []
        assert await wait_gone(unrecorded.pid)
        assert other.is_alive(bystander)  # another data dir's engine is none of ours
    finally:
        await first.stop(unrecorded, term_timeout_s=5)
        await other.stop(bystander, term_timeout_s=5)
