"""The store through its Python API: stored once, names, resolving refs, verify, temp dir cleanup."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from snapshots import (
    AmbiguousRef,
    SnapshotNotFound,
    SnapshotRecord,
    SnapshotStore,
    import_hf_dir,
)
from snapshots.owner import host_tag as _host_tag
from snapshots.store import TMP_PREFIX
from tests.snapshots.support import snapshot_dirs


@pytest.fixture
def imported(tiny_model_dir: Path, store: SnapshotStore) -> SnapshotRecord:
    return import_hf_dir(tiny_model_dir, store, name="tiny")


def source_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.iterdir() if p.is_file())


def test_import_records_bytes_dtype_and_exact_files(tiny_model_dir: Path, imported: SnapshotRecord) -> None:
    assert imported.bytes == source_bytes(tiny_model_dir)
    assert imported.dtype == "float32"
    assert imported.names == ("tiny",)
    assert imported.path.name == imported.id
    for src in tiny_model_dir.iterdir():
        assert (imported.path / src.name).read_bytes() == src.read_bytes()
    mode = (imported.path / "model.safetensors").stat().st_mode
    assert not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)  # exact bytes: read-only


def test_same_bytes_are_stored_once_under_every_name(
    tiny_model_dir: Path, store: SnapshotStore, imported: SnapshotRecord
) -> None:
    again = import_hf_dir(tiny_model_dir, store, name="tiny")
    other = import_hf_dir(tiny_model_dir, store, name="other")
    assert again.id == other.id == imported.id
    assert snapshot_dirs(store.root) == [imported.id]  # one dir, no temp dirs left behind
    [record] = store.list()
    assert record.names == ("other", "tiny")


def test_list_ignores_temp_and_index_dirs(store: SnapshotStore, imported: SnapshotRecord) -> None:
    (store.root / f"{TMP_PREFIX}elsewhere-1-abcd").mkdir()
    (store.root / "sources").mkdir()
    assert [r.id for r in store.list()] == [imported.id]


def test_resolve_by_id_prefix_and_name(store: SnapshotStore, imported: SnapshotRecord) -> None:
    for ref in (imported.id, imported.id.upper(), imported.id[:8], imported.id[:20], "tiny"):
        assert store.resolve(ref).id == imported.id, ref
    assert store.resolve("tiny").path == imported.path


@pytest.mark.parametrize(
    ("ref", "fragment"),
    [("nope", "no snapshot matches 'nope'"), ("0123456", "at least 8 hex"), ("f" * 64, "no snapshot ffff")],
)
def test_resolve_unknown_refs(
    store: SnapshotStore, imported: SnapshotRecord, ref: str, fragment: str
) -> None:
    with pytest.raises(SnapshotNotFound, match=fragment):
        store.resolve(ref)


def test_resolve_ambiguous_prefix(store: SnapshotStore) -> None:
    for tail in ("1" * 56, "2" * 56):
        (store.root / ("abcdef01" + tail)).mkdir(parents=True)
    with pytest.raises(AmbiguousRef, match="matches 2 snapshots"):
        store.resolve("abcdef01")
    assert store.resolve("abcdef011").id == "abcdef01" + "1" * 56


def test_a_name_moves_to_new_bytes(tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path) -> None:
    first = import_hf_dir(tiny_model_dir, store, name="m")
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in tiny_model_dir.iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    (changed / "generation_config.json").write_text('{"max_new_tokens": 3}')
    second = import_hf_dir(changed, store, name="m")
    assert second.id != first.id
    assert store.resolve("m").id == second.id
    assert store.resolve(first.id).names == ()


def writable(path: Path) -> Path:
    path.chmod(0o644)
    return path


def test_verify_good_snapshot(store: SnapshotStore, imported: SnapshotRecord) -> None:
    assert store.verify(imported.id) == []


def test_verify_finds_flipped_byte(store: SnapshotStore, imported: SnapshotRecord) -> None:
    weights = writable(imported.path / "model.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    [problem] = store.verify(imported.id)
    assert (problem.path, problem.kind) == ("model.safetensors", "corrupt")


def test_verify_finds_missing_truncated_and_unlisted_files(
    store: SnapshotStore, imported: SnapshotRecord
) -> None:
    (imported.path / "tokenizer.json").unlink()
    with open(writable(imported.path / "config.json"), "ab") as f:
        f.write(b" ")
    os.chmod(imported.path, 0o755)
    (imported.path / "extra.safetensors").write_bytes(b"x")
    found = {(p.path, p.kind) for p in store.verify(imported.id)}
    assert found == {
        ("tokenizer.json", "missing"),
        ("config.json", "size"),
        ("extra.safetensors", "unexpected"),
    }


def test_verify_finds_an_edited_manifest(store: SnapshotStore, imported: SnapshotRecord) -> None:
    manifest = writable(imported.path / "manifest.json")
    manifest.write_text(manifest.read_text().replace('"float32"', '"bfloat16"'))
    [problem] = store.verify(imported.id)
    assert (problem.path, problem.kind) == ("manifest.json", "manifest")


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)  # reaped by run(), so the pid is free


def test_stale_temp_dirs_are_judged_by_writer_pid(store: SnapshotStore) -> None:
    host = _host_tag()
    dead = store.root / f"{TMP_PREFIX}{host}-{dead_pid()}-0000"
    alive = store.root / f"{TMP_PREFIX}{host}-{os.getppid()}-0000"
    foreign = store.root / f"{TMP_PREFIX}not{socket.gethostname().replace('-', '')}x-1-0000"
    for d in (dead, alive, foreign):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "model.safetensors").write_bytes(b"partial")
    assert store.remove_stale_tmp() == [dead]
    assert not dead.exists() and alive.exists() and foreign.exists()


def test_staging_removes_its_dir_on_error(store: SnapshotStore) -> None:
    with pytest.raises(RuntimeError), store.staging() as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("writer failed")
    assert snapshot_dirs(store.root) == []
