"""The store's budget: LRU eviction, pins (across processes), make_room, remove, gc, and `ls`/`gc` in the CLI.

Snapshots here are a few KiB each (a config and one small safetensors file), built fresh per test;
the last-use clock is a fake one the test moves, so the LRU order never depends on timing.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from snapshots import SnapshotRecord, SnapshotStore, import_hf_dir, pulldir
from snapshots.errors import SnapshotNotFound, SnapshotPinned, StoreFull
from snapshots.eviction import Stored, plan_budget, plan_room
from snapshots.owner import host_tag as _host_tag
from snapshots.sizes import format_size, parse_size
from snapshots.store import TMP_PREFIX
from snapshots.usage import disk_free
from tests.deadlines import deadline
from tests.snapshots.support import RunCLI, assert_one_line_error, snapshot_dirs

KIB = 1024


class Clock:
    """Wall time that moves only when told to (a second per `tick`)."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> float:
        self.now += 1.0
        return self.now


def make_model(dst: Path, seed: int, kib: int = 4) -> Path:
    """A minimal importable model: config.json plus `kib` KiB of float32 weights, distinct per seed."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    save_file({"w": np.full(kib * KIB // 4, seed, dtype=np.float32)}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def models(tmp_path: Path) -> Iterator[Path]:
    """Source models 0, 1, 2... are made on demand under one dir: `models / "m3"` after `source(3)`."""
    yield tmp_path / "sources"


def source(models: Path, seed: int, kib: int = 4) -> Path:
    path = models / f"m{seed}"
    return path if path.exists() else make_model(path, seed, kib)


def fill(store: SnapshotStore, models: Path, clock: Clock, count: int) -> list[SnapshotRecord]:
    """Import `count` snapshots, one clock tick apart, named m0, m1, ..."""
    records = []
    for seed in range(count):
        clock.tick()
        records.append(import_hf_dir(source(models, seed), store, name=f"m{seed}"))
    return records


def budget_for(records: list[SnapshotRecord], count: int) -> int:
    """A budget that holds exactly `count` of these (equal-sized) snapshots, and not one byte more."""
    return count * records[0].bytes


PIN_AND_WAIT = """
import sys
from snapshots import SnapshotStore
pin = SnapshotStore(sys.argv[1]).pin(sys.argv[2], sys.argv[3])
print("pinned", flush=True)
sys.stdin.read()  # hold the pin until the test closes our stdin (or kills us)
"""


@pytest.fixture
def pin_elsewhere(home_env: dict[str, str]) -> Iterator:
    """Pin a snapshot from another process: `pin_elsewhere(root, id, holder)` returns the process."""
    procs: list[subprocess.Popen] = []

    def start(root: Path, snapshot_id: str, holder: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", PIN_AND_WAIT, str(root), snapshot_id, holder],
            env=home_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "pinned", "the pinning process failed"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# --- the pure decision -----------------------------------------------------------------------------

A, B, C = "a" * 64, "b" * 64, "c" * 64
GiB = 1 << 30


@pytest.mark.parametrize(
    ("snapshots", "nbytes", "budget", "free", "evict", "problem"),
    [
        # Fits: nothing to do.
        ([Stored(A, 400, 1, False)], 100, 1000, 10 * GiB, (), None),
        # LRU, not best fit: A is oldest, though C alone would free enough.
        (
            [Stored(A, 400, 1, False), Stored(B, 300, 3, True), Stored(C, 200, 2, False)],
            150,
            1000,
            10 * GiB,
            (A,),
            None,
        ),
        # Two go when one is not enough; the pinned one is skipped however old.
        (
            [Stored(A, 400, 1, True), Stored(B, 300, 3, False), Stored(C, 200, 2, False)],
            500,
            1000,
            10 * GiB,
            (C, B),
            None,
        ),
        # Ties in last use go by id, so every process picks the same victim.
        ([Stored(B, 300, 5, False), Stored(A, 300, 5, False)], 500, 1000, 10 * GiB, (A,), None),
        # No budget: only the disk (free minus the reserve of 100) limits.
        ([Stored(A, 400, 1, False), Stored(B, 300, 2, False)], 500, None, 550, (A,), None),
        # Pinned snapshots hold too much: all or nothing, so nothing.
        (
            [Stored(A, 400, 1, True), Stored(B, 300, 2, False)],
            800,
            1000,
            10 * GiB,
            (),
            "within the snapshot budget",
        ),
        # Bigger than the whole budget.
        ([], 2000, 1000, 10 * GiB, (), "more than the whole snapshot budget"),
        # The disk is short, and evicting everything unpinned would not cover it.
        ([Stored(A, 400, 1, False), Stored(B, 300, 2, True)], 1000, None, 500, (), "on disk"),
    ],
    ids=[
        "fits",
        "lru-not-best-fit",
        "two-skip-pinned",
        "tie-by-id",
        "disk-only",
        "pinned-hold",
        "too-big",
        "disk-short",
    ],
)
def test_plan_room(
    snapshots: list[Stored], nbytes: int, budget: int | None, free: int, evict: tuple, problem: str | None
) -> None:
    plan = plan_room(snapshots, nbytes, budget=budget, free=free, reserve=100)
    assert plan.evict == evict
    if problem is None:
        assert plan.problem is None
    else:
        assert plan.problem is not None and problem in plan.problem


def test_plan_budget_goes_as_far_as_pins_allow() -> None:
    snapshots = [Stored(A, 400, 1, True), Stored(B, 300, 2, False), Stored(C, 200, 3, False)]
    assert plan_budget(snapshots, 1000).evict == ()
    assert plan_budget(snapshots, 700).evict == (B,)
    over = plan_budget(snapshots, 300)
    assert over.evict == (B, C) and over.problem is not None and "pinned" in over.problem


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("512KiB", 512 * KIB),
        ("50G", 50 * GiB),
        ("20GB", 20 * 10**9),
        ("1.5 Mi", 3 * 512 * KIB),
        ("8m", 8 << 20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-5G", "5X", "1e9", "GiB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


# --- the store ---------------------------------------------------------------------------------------


def test_eviction_is_least_recently_used_by_touch_not_creation(
    store_root: Path, models: Path, clock: Clock
) -> None:
    store = SnapshotStore(store_root, clock=clock)
    m0, m1, m2 = fill(store, models, clock, 3)
    store = SnapshotStore(store_root, budget_for([m0], 3), clock=clock)
    clock.tick()
    store.touch(m0.id)  # created first, used last: now m1 is the least recently used
    assert [store.last_used(r.id) for r in (m1, m2, m0)] == sorted(
        store.last_used(r.id) for r in (m0, m1, m2)
    )

    clock.tick()
    m3 = import_hf_dir(source(models, 3), store, name="m3")
    assert set(store.ids()) == {m0.id, m2.id, m3.id}
    assert "m1" not in store.names()  # its name went with it
    with pytest.raises(SnapshotNotFound):
        store.resolve("m1")

    clock.tick()
    assert store.make_room(m0.bytes) == [m2.id]  # the next least recently used
    assert set(store.ids()) == {m0.id, m3.id}
    assert snapshot_dirs(store_root) == sorted([m0.id, m3.id])  # no trash left behind


def test_a_pinned_snapshot_survives_eviction(store_root: Path, models: Path, clock: Clock) -> None:
    m0, m1 = fill(SnapshotStore(store_root, clock=clock), models, clock, 2)
    store = SnapshotStore(store_root, budget_for([m0], 2), clock=clock)
    with store.pin(m0.id, "instance-1") as pin:
        assert store.is_pinned(m0.id) and not store.is_pinned(m1.id)
        assert store.pinned_by(m0.id) == ["instance-1"]
        assert store.make_room(m0.bytes) == [m1.id]  # m0 is older, but pinned
        with pytest.raises(StoreFull, match="1 pinned snapshot"):
            store.make_room(2 * m0.bytes)  # only the pinned one is left to go, and it may not
        assert store.ids() == [m0.id]
    assert not pin.held and not store.is_pinned(m0.id)
    assert store.make_room(m0.bytes) == []  # m0 alone fits under a budget of two
    assert store.make_room(2 * m0.bytes) == [m0.id]


def test_a_pin_held_by_another_process_blocks_eviction_gc_and_remove(
    store_root: Path, models: Path, clock: Clock, pin_elsewhere
) -> None:
    m0, m1 = fill(SnapshotStore(store_root, clock=clock), models, clock, 2)
    store = SnapshotStore(store_root, clock=clock)
    holder = pin_elsewhere(store_root, m0.id, "engine-7")

    assert store.is_pinned(m0.id)
    assert store.pinned_by(m0.id) == ["engine-7"]
    with pytest.raises(SnapshotPinned, match="engine-7"):
        store.remove(m0.id)
    report = store.gc(budget=1)
    assert report.evicted == [m1.id]
    assert report.problem is not None and "pinned" in report.problem
    assert store.ids() == [m0.id]

    holder.stdin.close()  # the holder exits normally: its pin goes with it
    holder.wait(timeout=deadline(30))
    assert not store.is_pinned(m0.id)
    assert store.remove(m0.id) is True
    assert store.ids() == [] and store.names() == {}
    assert store.remove(m0.id) is False


def test_the_pin_of_a_killed_process_does_not_block(
    store_root: Path, models: Path, clock: Clock, pin_elsewhere
) -> None:
    [m0] = fill(SnapshotStore(store_root, clock=clock), models, clock, 1)
    store = SnapshotStore(store_root, clock=clock)
    holder = pin_elsewhere(store_root, m0.id, "crashed")
    assert store.is_pinned(m0.id)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=deadline(30))
    assert holder.returncode == -signal.SIGKILL

    assert not store.is_pinned(m0.id)
    assert store.pinned_by(m0.id) == []  # its holder file is left, but nobody holds it
    leftovers = sorted(p.name for p in store.pins_dir.iterdir())
    assert any(".holder-" in name for name in leftovers)
    report = store.gc()
    assert [r.kind for r in report.removed] == ["pin"]
    assert store.ids() == [m0.id]
    assert store.make_room(0) == [] and store.remove(m0.id) is True


def test_pin_of_a_missing_snapshot_raises(store: SnapshotStore, models: Path, clock: Clock) -> None:
    with pytest.raises(SnapshotNotFound):
        store.pin("f" * 64, "nobody")
    [m0] = fill(store, models, clock, 1)
    assert store.remove(m0.id)
    with pytest.raises(SnapshotNotFound):
        store.pin(m0.id, "too-late")
    assert not store.is_pinned(m0.id)


def test_make_room_that_cannot_fit_raises_and_evicts_nothing(
    store_root: Path, models: Path, clock: Clock
) -> None:
    m0, m1, m2 = fill(SnapshotStore(store_root, clock=clock), models, clock, 3)
    store = SnapshotStore(store_root, budget_for([m0], 3), clock=clock)
    with store.pin(m2.id, "instance-1"):
        with pytest.raises(StoreFull, match="more than the whole snapshot budget"):
            store.make_room(budget_for([m0], 3) + 1)
        # Two unpinned ones could go, but room for three is needed besides the pinned one.
        with pytest.raises(StoreFull, match="within the snapshot budget") as raised:
            store.make_room(budget_for([m0], 3) - 1)
        assert "1 pinned snapshot(s) in use hold" in str(raised.value)
        assert str(store_root) in str(raised.value)
        free, _reserve = disk_free(store_root)
        unbudgeted = SnapshotStore(store_root, clock=clock)
        with pytest.raises(StoreFull, match="on disk"):
            unbudgeted.make_room(free + 10 * GiB)
        assert set(store.ids()) == {m0.id, m1.id, m2.id}


def test_an_import_over_budget_is_refused_before_a_byte_is_written(
    store_root: Path, models: Path, clock: Clock
) -> None:
    m0 = make_model(models / "big", 0, kib=16)
    store = SnapshotStore(store_root, 8 * KIB, clock=clock)
    with pytest.raises(StoreFull, match=r"more than the whole snapshot budget of 8\.0 KiB"):
        import_hf_dir(m0, store, name="big")
    assert snapshot_dirs(store_root) == [] and store.names() == {}


def test_remove_is_atomic_to_readers_and_cleans_the_index(
    store: SnapshotStore, models: Path, clock: Clock
) -> None:
    [m0] = fill(store, models, clock, 1)
    store.remember_source("9" * 64, m0.id)
    with store.pin(m0.id, "reader"), pytest.raises(SnapshotPinned, match="reader"):
        store.remove(m0.id)
    assert store.verify(m0.id) == []  # untouched by the refused remove
    assert store.remove(m0.id)
    assert store.ids() == [] and store.names() == {}
    assert store.lookup_source("9" * 64) is None
    assert not (store.root / "sources" / ("9" * 64)).exists()
    assert not (store.used_dir / m0.id).exists()
    assert snapshot_dirs(store.root) == []


def test_a_fresh_store_object_sees_the_same_sizes_order_and_pins(
    store_root: Path, models: Path, clock: Clock
) -> None:
    first = SnapshotStore(store_root, clock=clock)
    records = fill(first, models, clock, 4)
    clock.tick()
    first.touch(records[0].id)
    pin = first.pin(records[1].id, "kept")

    again = SnapshotStore(store_root, budget_for(records, 4))  # the real clock: nothing shared in memory
    for r in records:
        assert again.last_used(r.id) == first.last_used(r.id)
        assert again.is_pinned(r.id) == (r.id == records[1].id)
        assert again.record(r.id).bytes == r.bytes
    order = sorted(again.ids(), key=again.last_used)
    assert order == [records[1].id, records[2].id, records[3].id, records[0].id]
    # m1 is least recently used but pinned, so m2 goes: the same choice the first store would make.
    assert again.make_room(records[0].bytes) == [records[2].id]
    pin.release()


def test_gc_removes_leftovers_and_evicts_down_to_the_budget(
    store_root: Path, models: Path, clock: Clock
) -> None:
    m0, m1, m2 = fill(SnapshotStore(store_root, clock=clock), models, clock, 3)
    store = SnapshotStore(store_root, clock=clock)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale_tmp = store_root / f"{TMP_PREFIX}{_host_tag()}-{int(dead.stdout)}-0000"
    live_tmp = store_root / f"{TMP_PREFIX}{_host_tag()}-{os.getpid()}-0000"
    for d in (stale_tmp, live_tmp):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 3000)
    trash = store_root / ".trash-0123456789abcdef"
    trash.mkdir()
    (trash / "config.json").write_text("{}")
    stale_pull = store.pull_dir("d" * 64)
    stale_pull.mkdir()
    (stale_pull / "model.safetensors").write_bytes(b"\1" * 5000)
    pulldir.journal_path(stale_pull).write_text("{}\n")
    live_pull = store.pull_dir("e" * 64)
    live_pull.mkdir()
    lock = os.open(pulldir.lock_path(live_pull), os.O_RDWR | os.O_CREAT)  # a pull in progress holds it
    fcntl.flock(lock, fcntl.LOCK_EX)
    store.set_name("dangling", "f" * 64)
    store.remember_source("8" * 64, "f" * 64)
    (store.used_dir / ("f" * 64)).touch()

    try:
        dry = store.gc(budget=m0.bytes * 2, dry_run=True)
        assert dry.dry_run and dry.evicted == [m0.id]
        assert stale_tmp.exists() and trash.exists() and stale_pull.exists() and m0.path.exists()
        assert "dangling" in store.names()

        report = store.gc(budget=m0.bytes * 2)
        assert [(r.kind, r.path) for r in report.removed] == [(r.kind, r.path) for r in dry.removed]
        kinds = sorted(r.kind for r in report.removed)
        assert kinds == ["name", "pull", "pull", "snapshot", "source", "temp", "trash", "used"]
        assert report.evicted == [m0.id]
        assert report.stored_bytes == m1.bytes + m2.bytes
        assert report.bytes_freed >= 3000 + 5000 + m0.bytes
        assert report.problem is None
        assert set(store.ids()) == {m1.id, m2.id}
        assert store.names() == {"m1": m1.id, "m2": m2.id}
        live = [live_tmp.name, live_pull.name, pulldir.lock_path(live_pull).name]
        assert snapshot_dirs(store_root) == sorted([m1.id, m2.id, *live])
        assert store.gc(budget=m0.bytes * 2).removed == ()  # nothing left to do
    finally:
        os.close(lock)
    assert [r.kind for r in store.gc().removed] == ["pull"]  # its pull is over now


# --- the CLI ---------------------------------------------------------------------------------------


def cli_json(cli: RunCLI, *args: str) -> dict | list:
    proc = cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_ls_json_shows_size_use_pins_and_where(
    cli: RunCLI, store_root: Path, models: Path, pin_elsewhere
) -> None:
    for seed in range(3):
        assert cli("import", str(source(models, seed)), "--name", f"m{seed}").returncode == 0
    listed = cli_json(cli, "ls")
    assert [e["name"] for e in listed] == ["m2", "m1", "m0"]  # most recently used first
    first = listed[-1]
    pin_elsewhere(store_root, first["id"], "engine-3")
    SnapshotStore(store_root).touch(first["id"])

    listed = cli_json(cli, "ls")
    assert [e["name"] for e in listed] == ["m0", "m2", "m1"]
    top = listed[0]
    assert {
        "id",
        "names",
        "path",
        "bytes",
        "dtype",
        "created",
        "last_used",
        "pinned",
        "pinned_by",
        "remotes",
        "page_cache",
    } <= set(top)
    assert (top["pinned"], top["pinned_by"]) == (True, ["engine-3"])
    assert [(e["pinned"], e["pinned_by"]) for e in listed[1:]] == [(False, []), (False, [])]
    assert top["bytes"] == sum(p.stat().st_size for p in source(models, 0).iterdir())
    assert top["path"] == str(store_root / top["id"])
    assert top["remotes"] == []
    assert top["last_used"] >= listed[1]["last_used"]
    assert top["page_cache"] is None or 0.0 <= top["page_cache"] <= 1.0

    table = cli("ls").stdout.splitlines()
    assert str(store_root) in table[0]
    assert table[1].split()[:4] == ["ID", "NAME", "DTYPE", "SIZE"]
    assert table[2].split()[:3] == [top["id"][:12], "m0", "float32"]
    assert "engine-3" in table[2] and table[2].rstrip().endswith("local")
    assert max(len(line) for line in table[1:]) <= 100


def test_gc_json_and_dry_run(cli: RunCLI, store_root: Path, models: Path) -> None:
    for seed in range(3):
        assert cli("import", str(source(models, seed)), "--name", f"m{seed}").returncode == 0
    oldest = cli_json(cli, "ls")[-1]
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (store_root / f"{TMP_PREFIX}{_host_tag()}-{int(dead.stdout)}-0000").mkdir()
    budget = str(2 * oldest["bytes"])

    dry = cli_json(cli, "gc", "--budget", budget, "--dry-run")
    assert dry["dry_run"] is True and dry["evicted"] == [oldest["id"]]
    assert len(cli_json(cli, "ls")) == 3

    human = cli("gc", "--budget", budget, "--dry-run")
    assert human.returncode == 0
    assert "would remove" in human.stdout and oldest["id"][:12] in human.stdout and "m0" in human.stdout

    done = cli_json(cli, "gc", "--budget", budget)
    assert set(done) == {"dry_run", "removed", "evicted", "bytes_freed", "budget", "stored_bytes", "problem"}
    assert done["evicted"] == [oldest["id"]] and done["budget"] == 2 * oldest["bytes"]
    assert sorted(r["kind"] for r in done["removed"]) == ["snapshot", "temp"]
    assert done["bytes_freed"] >= oldest["bytes"] and done["stored_bytes"] == 2 * oldest["bytes"]
    assert [e["name"] for e in cli_json(cli, "ls")] == ["m2", "m1"]
    nothing = cli("gc")
    assert nothing.returncode == 0 and "nothing to remove" in nothing.stdout


def test_the_budget_from_the_environment_governs_imports(
    cli: RunCLI, home_env: dict[str, str], models: Path, store_root: Path
) -> None:
    env = {**home_env, "STOKER_SNAPSHOT_BUDGET": "9KiB"}  # two 4 KiB snapshots, not three
    run = [sys.executable, "-m", "stoker.cli.main", "snapshot"]
    for seed in range(3):
        proc = subprocess.run(
            [*run, "import", str(source(models, seed))], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
    assert [e["name"] for e in cli_json(cli, "ls")] == ["m2", "m1"]
    big = make_model(models / "big", 9, kib=16)
    proc = subprocess.run([*run, "import", str(big)], env=env, capture_output=True, text=True)
    assert_one_line_error(proc, f"more than the whole snapshot budget of {format_size(9 * KIB)}")
    assert [e["name"] for e in cli_json(cli, "ls")] == ["m2", "m1"]  # refused: nothing evicted


@pytest.mark.parametrize("command", [["ls"], ["gc"], ["import", "{src}"]])
def test_a_bad_budget_is_a_one_line_error(
    home_env: dict[str, str], models: Path, store_root: Path, command: list[str]
) -> None:
    args = [a.format(src=source(models, 0)) for a in command]
    env = {**home_env, "STOKER_SNAPSHOT_BUDGET": "lots"}
    proc = subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "snapshot", *args], env=env, capture_output=True, text=True
    )
    assert_one_line_error(proc, "STOKER_SNAPSHOT_BUDGET", "'lots' is not a size")
    assert snapshot_dirs(store_root) == []


@pytest.mark.parametrize(("value", "fragment"), [("ten", "'ten' is not a size"), ("0", "no room at all")])
def test_a_bad_gc_budget_flag_is_a_one_line_error(cli: RunCLI, value: str, fragment: str) -> None:
    assert_one_line_error(cli("gc", "--budget", value), "--budget", fragment)


def test_the_store_can_live_elsewhere_by_flag_or_environment(
    cli: RunCLI, home_env: dict[str, str], models: Path, store_root: Path, tmp_path: Path
) -> None:
    run = [sys.executable, "-m", "stoker.cli.main", "snapshot"]
    nvme = tmp_path / "nvme" / "snapshots"
    for argv in (
        ["--store", str(nvme), "import", str(source(models, 0))],
        ["import", str(source(models, 1)), "--store", str(nvme)],
    ):
        proc = subprocess.run([*run, *argv], env=home_env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert snapshot_dirs(store_root) == []  # not in $STOKER_HOME/snapshots
    by_env = {**home_env, "STOKER_SNAPSHOT_STORE": str(nvme)}
    listed = subprocess.run([*run, "ls", "--json"], env=by_env, capture_output=True, text=True)
    assert sorted(e["name"] for e in json.loads(listed.stdout)) == ["m0", "m1"]
    assert cli_json(cli, "ls") == []
