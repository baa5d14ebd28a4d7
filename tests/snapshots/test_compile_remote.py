# ruff: noqa: F401, F811  (pytest finds the S3 fixtures imported from test_remote by their names)
"""Compile caches travel with their snapshot through object storage (a real S3 server, moto, on
loopback): pushed beside it, pulled with it onto another node's store, and never trusted blindly."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from snapshots import SnapshotRecord, SnapshotStore
from snapshots.compile_cache import CompileCaches, CompileKey
from snapshots.compile_remote import pack
from snapshots.importer import import_hf_dir
from snapshots.remote import pull, push
from tests.snapshots.test_remote import (  # the S3 server, bucket and credentials fixtures
    MiB,
    bucket,
    config,
    env,
    make_model,
    moto,
    s3,
)


@pytest.fixture
def snapshot(store: SnapshotStore, tmp_path: Path) -> SnapshotRecord:
    return import_hf_dir(make_model(tmp_path / "model", MiB), store)


def keep_cache(store: SnapshotStore, snapshot_id: str, version: str = "0.32.0+cpu") -> CompileKey:
    """A committed cache as a vLLM start leaves it: nested files of compiled code."""
    caches = CompileCaches(store.root)
    key = CompileKey.of(snapshot_id, "vllm", version, {"dtype": "float32", "args": "--max-num-seqs 8"})
    work, _ = caches.checkout(key)
    (work / "torch_compile_cache" / "h" / "rank_0_0").mkdir(parents=True)
    (work / "torch_compile_cache" / "h" / "rank_0_0" / "model").write_bytes(b"compiled" * 1000)
    (work / "modelinfos").mkdir()
    (work / "modelinfos" / "llama.json").write_text('{"x": 1}')
    assert caches.commit(key, work)
    caches.discard(work)
    return key


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


async def test_a_cache_built_on_one_node_starts_the_next_one(
    env, moto, s3, bucket, store, snapshot, tmp_path
):
    key = keep_cache(store, snapshot.id)
    uri, cfg = f"s3://{bucket}/m", config(moto.url)
    pushed = await push(store, snapshot.id, uri, cfg)
    assert pushed.compile_caches == 1
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="m/compile/")["Contents"]}
    assert keys == {f"m/compile/{key.digest}.tar", f"m/compile/{key.digest}.json"}
    assert (await push(store, snapshot.id, uri, cfg)).compile_caches == 0  # the same bytes: not sent again

    node2 = SnapshotStore(tmp_path / "node2")
    pulled = await pull(node2, uri, cfg)
    assert (pulled.id, pulled.compile_caches) == (snapshot.id, 1)
    here, there = CompileCaches(store.root).path(key), CompileCaches(node2.root).path(key)
    assert files(there) == files(here)
    assert (await pull(node2, uri, cfg)).compile_caches == 0  # kept already

    # A node that already holds the snapshot still gets a cache compiled elsewhere later.
    later = keep_cache(store, snapshot.id, version="0.33.0+cpu")
    await push(store, snapshot.id, uri, cfg)
    assert (await pull(node2, uri, cfg)).compile_caches == 1
    assert CompileCaches(node2.root).has(later)


def put(s3: Any, bucket: str, key: str, body: bytes, **extra: Any) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=body, **extra)


def index(key: CompileKey, tar: bytes, **changes: Any) -> bytes:
    doc = {**key.to_dict(), "size": len(tar), "sha256": hashlib.sha256(tar).hexdigest(), **changes}
    return json.dumps(doc).encode()


def hostile_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    return buf.getvalue()


async def test_a_cache_that_fails_any_check_is_skipped_and_the_snapshot_served(
    env, moto, s3, bucket, store, snapshot, tmp_path, caplog
):
    uri, cfg = f"s3://{bucket}/m", config(moto.url)
    await push(store, snapshot.id, uri, cfg)
    good = keep_cache(store, snapshot.id)
    tar = pack(CompileCaches(store.root).path(good))
    other = CompileKey.of("f" * 64, "vllm", "1", {})
    bad = {
        # the tar was changed after its index was written
        "tampered": (good, tar + b"x" * 512, index(good, tar)),
        # an index whose inputs do not hash to its name
        "renamed": (CompileKey.of(snapshot.id, "vllm", "9", {}), tar, index(good, tar)),
        # an index for another snapshot, copied beside this one
        "foreign": (other, tar, index(other, tar)),
        # a tar that would write outside its dir
        "escaping": (
            CompileKey.of(snapshot.id, "vllm", "2", {}),
            hostile_tar(),
            index(CompileKey.of(snapshot.id, "vllm", "2", {}), hostile_tar()),
        ),
        # an index that claims more than a cache may be
        "huge": (
            CompileKey.of(snapshot.id, "vllm", "3", {}),
            tar,
            index(CompileKey.of(snapshot.id, "vllm", "3", {}), tar, size=2 << 30),
        ),
    }
    for key, body, idx in bad.values():
        put(s3, bucket, f"m/compile/{key.digest}.tar", body)
        put(s3, bucket, f"m/compile/{key.digest}.json", idx)

    node2 = SnapshotStore(tmp_path / "node2")
    pulled = await pull(node2, uri, cfg)
    assert pulled.id == snapshot.id and pulled.compile_caches == 0
    assert node2.verify(snapshot.id) == []
    caches = CompileCaches(node2.root)
    assert caches.list(snapshot.id) == []
    assert not (tmp_path / "escaped").exists() and not (node2.root / "escaped").exists()
    assert not any(p.name.startswith(".tmp") for p in caches.snapshot_dir(snapshot.id).iterdir())
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == len(bad)
