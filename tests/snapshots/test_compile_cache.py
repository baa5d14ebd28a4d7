"""Compile caches beside their snapshot: keyed, copied per instance, committed once, counted in the
snapshot's size, evicted and removed with it, and cleaned up by gc when their owner is gone."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from snapshots import SnapshotStore, import_hf_dir
from snapshots.compile_cache import CompileCaches, CompileKey
from snapshots.usage import observe
from tests.deadlines import deadline
from tests.snapshots.test_budget import make_model

KEY_ARGS = {"dtype": "float32", "max_model_len": "2048", "gpus": "0", "args": ""}


def key_for(snapshot_id: str, **changes: str) -> CompileKey:
    version = changes.pop("version", "0.32.0+cpu")
    return CompileKey.of(snapshot_id, "vllm", version, {**KEY_ARGS, **changes})


def compiled(work: Path, nbytes: int = 1000) -> None:
    """What vLLM leaves in its cache root after compiling (a few files, nested)."""
    (work / "torch_compile_cache" / "abc" / "rank_0_0").mkdir(parents=True)
    (work / "torch_compile_cache" / "abc" / "rank_0_0" / "model").write_bytes(b"x" * nbytes)
    (work / "modelinfos.json").write_text("{}")


@pytest.fixture
def snapshot(store: SnapshotStore, tmp_path: Path) -> str:
    return import_hf_dir(make_model(tmp_path / "m", seed=1), store, name="m").id


def test_the_key_names_snapshot_version_and_arguments_and_nothing_else(snapshot):
    base = key_for(snapshot)
    assert base.digest == key_for(snapshot).digest
    assert base == CompileKey.of(snapshot, "vllm", "0.32.0+cpu", dict(reversed(list(KEY_ARGS.items()))))
    others = [key_for(snapshot, version="0.33.0+cpu"), key_for(snapshot, dtype="bfloat16"), key_for("0" * 64)]
    assert len({base.digest, *(k.digest for k in others)}) == 4


def test_a_first_start_compiles_and_commits_the_next_starts_from_a_copy(store, snapshot):
    caches, key = CompileCaches(store.root), key_for(snapshot)
    work, hit = caches.checkout(key)
    assert not hit and work.is_dir() and not any(work.iterdir())
    compiled(work)
    assert caches.commit(key, work)
    info = json.loads((caches.path(key) / "cache.json").read_text())
    assert info == {"snapshot": snapshot, "engine": "vllm", "version": "0.32.0+cpu", "args": KEY_ARGS}

    again, hit = caches.checkout(key)
    assert hit and again != work
    assert (again / "torch_compile_cache" / "abc" / "rank_0_0" / "model").read_bytes() == b"x" * 1000
    assert not (again / "cache.json").exists()  # the key file stays with the committed copy
    # A second instance that compiled too (started before the first committed) keeps nothing more.
    assert not caches.commit(key, again)
    (again / "modelinfos.json").write_text("changed by the running instance")
    assert (caches.path(key) / "modelinfos.json").read_text() == "{}"  # its copy was its own
    caches.discard(work)
    caches.discard(again)
    assert [c.digest for c in caches.list(snapshot)] == [key.digest]


def _commit_in_child(root: str, key: CompileKey, work: str, out) -> None:
    out.put(CompileCaches(Path(root)).commit(key, Path(work)))


def test_two_processes_committing_at_once_keep_exactly_one(store, snapshot):
    caches, key = CompileCaches(store.root), key_for(snapshot)
    works = []
    for _ in range(4):
        work, _ = caches.checkout(key)
        compiled(work, nbytes=200_000)
        works.append(work)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    children = [ctx.Process(target=_commit_in_child, args=(str(store.root), key, str(w), out)) for w in works]
    for c in children:
        c.start()
    for c in children:
        c.join(30)
    assert sorted(out.get(timeout=deadline(5)) for _ in children) == [False, False, False, True]
    left = sorted(p.name for p in caches.snapshot_dir(snapshot).iterdir())
    assert left == sorted([key.digest, *(w.name for w in works)])  # no temp copy left behind


def test_caches_count_in_the_snapshots_size_and_go_with_it(store, snapshot):
    caches, key = CompileCaches(store.root), key_for(snapshot)
    before = {s.id: s.bytes for s in observe(store)}[snapshot]
    work, _ = caches.checkout(key)
    compiled(work, nbytes=50_000)
    caches.commit(key, work)
    caches.discard(work)
    after = {s.id: s.bytes for s in observe(store)}[snapshot]
    assert after - before == caches.bytes_of(snapshot) >= 50_000
    assert store.remove(snapshot)
    assert not caches.snapshot_dir(snapshot).exists()
    assert not any(p.name.startswith(".trash") for p in caches.root.iterdir())


def test_gc_clears_caches_of_gone_snapshots_and_copies_of_gone_processes(store, snapshot, tmp_path):
    caches, key = CompileCaches(store.root), key_for(snapshot)
    live, _ = caches.checkout(key)  # this process's: kept
    dead = caches.snapshot_dir(snapshot) / f"{live.name.rsplit('-', 2)[0]}-{_dead_pid()}-00000000"
    dead.mkdir()
    orphan = caches.snapshot_dir("f" * 64)  # a snapshot removed by an older version, say
    orphan.mkdir(parents=True)
    report = store.gc()
    removed = {Path(r["path"]) for r in report.to_dict()["removed"] if r["kind"] == "compile"}
    assert removed == {dead, orphan}
    assert live.is_dir() and not dead.exists() and not orphan.exists()


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
