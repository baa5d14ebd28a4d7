"""Verified starts: import reads each file through a checked descriptor and never widens its mode;
a start checks the store's files against the manifest (sizes always, hashes unless unchanged since
they last hashed sound); `stoker engine` refuses a snapshot it cannot load in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snapshots import CorruptSnapshot, InvalidSource, SnapshotStore, UnsafeFileError, import_hf_dir
from snapshots import verify as verify_module
from snapshots.durable import open_regular_nofollow
from tests.deadlines import deadline
from tests.snapshots.support import assert_one_line_error

SECRET = b"root-only secret 0600 do not copy"


def secret_file(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


def store_holds(root: Path, data: bytes) -> bool:
    return any(data in p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def writable(path: Path) -> Path:
    path.chmod(0o644)  # the store makes its files read-only
    return path


# --- reading a source file through a checked descriptor -------------------------------------------


def test_open_regular_nofollow_reads_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    st = path.stat()
    with os.fdopen(open_regular_nofollow(path, (st.st_dev, st.st_ino)), "rb") as f:
        assert f.read() == b"abc"


def test_open_regular_nofollow_refuses_a_symlink(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(secret_file(tmp_path))
    with pytest.raises(InvalidSource, match="symlink"):
        open_regular_nofollow(link)


def test_open_regular_nofollow_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InvalidSource, match="not a regular file"):
        open_regular_nofollow(fifo)


def test_a_file_swapped_after_the_scan_is_refused(tmp_path: Path) -> None:
    # What a swap between the check and the copy looks like at the descriptor: another inode.
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"approved")
    st = path.stat()
    approved = (st.st_dev, st.st_ino)
    path.unlink()
    shutil.copyfile(secret_file(tmp_path), path)  # a different file under the approved name
    with pytest.raises(InvalidSource, match="replaced"):
        open_regular_nofollow(path, approved)


# --- import -----------------------------------------------------------------------------------------


def test_import_refuses_a_symlink_to_a_secret_and_copies_none_of_it(tmp_path: Path, tiny_model_dir: Path):
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    (src / "extra.json").symlink_to(secret_file(tmp_path))
    store = SnapshotStore(tmp_path / "store")
    with pytest.raises(UnsafeFileError, match="symlink"):
        import_hf_dir(src, store)
    assert store.ids() == [] and not store_holds(store.root, SECRET)


def test_import_of_a_swapped_file_stores_nothing(tmp_path: Path, tiny_model_dir: Path, monkeypatch):
    # The race made deterministic: the scan approves a file, which becomes a symlink to the secret
    # before the copy opens it (the swap is done in the scan's return, none of our code is hooked).
    from snapshots import importer

    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    secret = secret_file(tmp_path)
    real_scan = importer.scan_hf_dir

    def scan_then_swap(path: Path):
        files = real_scan(path)
        (src / "tokenizer.json").unlink()
        (src / "tokenizer.json").symlink_to(secret)
        return files

    monkeypatch.setattr(importer, "scan_hf_dir", scan_then_swap)
    store = SnapshotStore(tmp_path / "store")
    with pytest.raises(InvalidSource, match=r"tokenizer\.json"):
        import_hf_dir(src, store)
    assert store.ids() == [] and not store_holds(store.root, SECRET)


def test_a_stored_file_is_never_more_readable_than_its_source(tmp_path: Path, tiny_model_dir: Path):
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    (src / "config.json").chmod(0o600)
    (src / "tokenizer.json").chmod(0o640)
    (src / "model.safetensors").chmod(0o644)
    record = import_hf_dir(src, SnapshotStore(tmp_path / "store"))
    modes = {p.name: p.stat().st_mode & 0o777 for p in record.path.iterdir()}
    assert modes["config.json"] == 0o400
    assert modes["tokenizer.json"] == 0o440
    assert modes["model.safetensors"] == 0o444  # from a 0644 source: read-only, as before
    assert modes["manifest.json"] == 0o444


# --- the start-time check -----------------------------------------------------------------------------


@pytest.fixture
def imported(tmp_path: Path, tiny_model_dir: Path) -> tuple[SnapshotStore, str]:
    store = SnapshotStore(tmp_path / "store")
    return store, import_hf_dir(tiny_model_dir, store).id


def count_hashes(monkeypatch) -> list[int]:
    hashed: list[int] = []
    real = verify_module.hash_stream

    def counting(f):
        hashed.append(1)
        return real(f)

    monkeypatch.setattr(verify_module, "hash_stream", counting)
    return hashed


def test_a_fresh_import_starts_on_stats_alone(imported, monkeypatch) -> None:
    store, snapshot_id = imported
    hashed = count_hashes(monkeypatch)
    store.check_for_start(snapshot_id)
    assert hashed == []  # hashed on the way in; unchanged since


def test_without_a_stamp_every_file_is_hashed_once(imported, monkeypatch) -> None:
    store, snapshot_id = imported
    (store.verified_dir / snapshot_id).unlink()
    hashed = count_hashes(monkeypatch)
    store.check_for_start(snapshot_id)
    files = len(store.manifest(snapshot_id).files)
    assert len(hashed) == files
    store.check_for_start(snapshot_id)
    assert len(hashed) == files  # stamped by the first check


def test_a_truncated_file_fails_the_start_naming_it(imported) -> None:
    store, snapshot_id = imported
    os.truncate(writable(store.path_of(snapshot_id) / "model.safetensors"), 100)
    with pytest.raises(CorruptSnapshot) as caught:
        store.check_for_start(snapshot_id)
    message = str(caught.value)
    assert f"snapshot {snapshot_id[:12]} is corrupt" in message and "model.safetensors" in message
    assert "\n" not in message
    assert [p.kind for p in store.verify(snapshot_id)] == ["size"]  # verify agrees


def test_a_same_size_rewrite_is_hashed_again_and_caught(imported) -> None:
    store, snapshot_id = imported
    path = writable(store.path_of(snapshot_id) / "config.json")
    st = path.stat()
    data = path.read_bytes()
    path.write_bytes(data.replace(b"{", b" ", 1))  # same size, other bytes
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back; the ctime cannot be
    with pytest.raises(CorruptSnapshot, match=r"config\.json: corrupt"):
        store.check_for_start(snapshot_id)


def test_a_stray_file_fails_the_start(imported) -> None:
    store, snapshot_id = imported
    (store.path_of(snapshot_id) / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(CorruptSnapshot, match=r"extra\.safetensors: not listed"):
        store.check_for_start(snapshot_id)


# --- stoker engine ------------------------------------------------------------------------------------


def engine(env: dict[str, str], snapshot: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "engine", "--snapshot", snapshot, "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(120),
    )


def test_engine_refuses_a_corrupt_store_snapshot_in_one_line(home_env, store, tiny_model_dir) -> None:
    snapshot_id = import_hf_dir(tiny_model_dir, store, name="tiny").id
    os.truncate(writable(store.path_of(snapshot_id) / "model.safetensors"), 100)
    proc = engine(home_env, "tiny")
    assert proc.returncode == 1
    assert_one_line_error(proc, f"snapshot {snapshot_id[:12]} is corrupt", "model.safetensors")


def test_engine_refuses_a_truncated_safetensors_directory_in_one_line(home_env, tmp_path, tiny_model_dir):
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    os.truncate(src / "model.safetensors", (src / "model.safetensors").stat().st_size // 2)
    proc = engine(home_env, str(src))
    assert proc.returncode == 1
    assert_one_line_error(proc, "model.safetensors is not a valid safetensors file")
