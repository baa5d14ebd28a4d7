"""The page-cache tier on real files: warm, residency (mincore), drop (fadvise), and `stoker snapshot warm`."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from snapshots import SnapshotNotFound, WarmReport, pagecache
from tests.snapshots.support import RunCLI, assert_one_line_error

MiB = 1 << 20


def write(path: Path, size: int) -> Path:
    """A file of random bytes, written back to disk so that its pages are clean (droppable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    return path


def fs_type(path: Path) -> str:
    """The type of the filesystem holding `path` (longest mount point that contains it)."""
    real, best, kind = os.path.realpath(path), "", "?"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        mount = mount.replace("\\040", " ")
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind


@pytest.fixture
def snapshot_dir(tmp_path: Path) -> Path:
    """A snapshot-shaped directory: one weights file of a few MiB, small files, a nested one, an empty one."""
    d = tmp_path / "snap"
    write(d / "model.safetensors", 6 * MiB + 123)  # not a whole number of pages
    write(d / "config.json", 700)
    write(d / "tokenizer" / "tokenizer.json", 40_000)
    write(d / "empty.txt", 0)
    return d


def test_warm_reads_every_byte_and_leaves_the_snapshot_resident(snapshot_dir: Path):
    pagecache.drop(snapshot_dir)
    report = pagecache.warm(snapshot_dir)
    assert isinstance(report, WarmReport)
    assert report.bytes == 6 * MiB + 123 + 700 + 40_000
    assert report.files == 4
    assert report.seconds > 0 and report.gb_per_s > 0
    assert pagecache.residency(snapshot_dir) == pytest.approx(1.0, abs=0.01)
    assert pagecache.residency(snapshot_dir / "config.json") == 1.0


def test_drop_then_residency_falls_and_measuring_does_not_fault_pages_in(snapshot_dir: Path):
    if (kind := fs_type(snapshot_dir)) in ("tmpfs", "ramfs"):
        pytest.skip(f"{snapshot_dir} is on {kind}: its page cache is the file itself, nothing drops")
    weights = snapshot_dir / "model.safetensors"
    pagecache.warm(weights)
    assert pagecache.residency(weights) == pytest.approx(1.0, abs=0.01)
    pagecache.drop(snapshot_dir)
    after = pagecache.residency(weights)
    # Clean pages that nobody maps are dropped; allow for a few a concurrent reader could pull back.
    assert after < 0.5, f"{after:.0%} still cached after drop on {fs_type(weights)}"
    assert pagecache.residency(weights) <= after + 0.01  # mincore on a fresh mapping faulted nothing in
    pagecache.warm(snapshot_dir)
    assert pagecache.residency(weights) == pytest.approx(1.0, abs=0.01)


def test_warm_reads_through_one_bounded_buffer(tmp_path: Path):
    chunk = 256 * 1024
    weights = write(tmp_path / "model.safetensors", 16 * chunk)
    tracemalloc.start()
    try:
        report = pagecache.warm(weights, chunk_bytes=chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.bytes == 16 * chunk
    assert peak < 2 * chunk, f"warming a {16 * chunk} B file allocated {peak} B at peak"


def test_an_empty_snapshot_is_trivially_resident(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    report = pagecache.warm(tmp_path / "empty")
    assert (report.bytes, report.files) == (0, 0)
    assert pagecache.residency(tmp_path / "empty") == 1.0


@pytest.mark.parametrize("call", [pagecache.warm, pagecache.residency, pagecache.drop])
def test_a_missing_path_is_a_snapshot_error(tmp_path: Path, call):
    with pytest.raises(SnapshotNotFound, match=r"no such file or directory: .*nowhere"):
        call(tmp_path / "nowhere")


# ---- stoker snapshot warm ------------------------------------------------------------------------------


def test_cli_warm_json_reports_bytes_speed_and_residency(cli: RunCLI, tiny_model_dir: Path):
    imported = cli("import", str(tiny_model_dir), "--json")
    assert imported.returncode == 0, imported.stderr
    record = json.loads(imported.stdout)
    pagecache.drop(record["path"])

    proc = cli("warm", record["id"][:12], "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {
        "id",
        "path",
        "bytes",
        "files",
        "seconds",
        "gb_per_s",
        "residency_before",
        "residency_after",
    }
    on_disk = [p for p in Path(record["path"]).rglob("*") if p.is_file()]
    assert (out["id"], out["path"]) == (record["id"], record["path"])
    assert (out["bytes"], out["files"]) == (sum(p.stat().st_size for p in on_disk), len(on_disk))
    assert out["gb_per_s"] == pytest.approx(out["bytes"] / out["seconds"] / 1e9, rel=0.01)
    assert out["residency_after"] == pytest.approx(1.0, abs=0.01)
    if fs_type(Path(record["path"])) not in ("tmpfs", "ramfs"):
        assert out["residency_before"] < out["residency_after"]

    human = cli("warm", "tiny-llama")  # by name, for people
    assert human.returncode == 0, human.stderr
    assert record["id"][:12] in human.stdout and "GB/s" in human.stdout and "100%" in human.stdout


def test_cli_warm_of_an_unknown_ref_is_one_line(cli: RunCLI):
    assert_one_line_error(cli("warm", "nosuch"), "nosuch")
