"""Warm KV across scale-to-zero (`stoker.engine.kv_keep`), on real engine processes and the tiny model.

A prompt of several full 32-token blocks is answered (greedy, with logprobs) by an engine that keeps
no KV; an engine that keeps it answers the same after a sleep and wake and after a restart, with the
prompt's blocks restored before READY and counted as prefix-cache hits (`vllm:prefix_cache_hits`).
A corrupt, truncated or foreign file is ignored and counted by reason; the byte bound holds; an
engine of another scope (another deployment, so another tenant) loads nothing. That the store
evicts kept KV with its snapshot is tests/snapshots/test_kept_kv.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

from snapshots.kept_kv import KeptKv
from stoker.engine.kv_keep import Block, KeepConfig, KvKeep, Rejected, choose
from stoker.engine.metrics import EngineMetrics
from tests.conftest import build_tiny_adapter
from tests.deadlines import COLD_ANSWER, HTTP_READ

PROMPT = " ".join(["a returning conversation opens with the same long system prompt"] * 14)
GREEDY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}
BLOCK_BYTES = 32 * 512  # the tiny model: 2 layers x (K, V) x 2 heads x 16 x 4 B = 512 B a token


def blk(h: int, parent: int | None, hits: int) -> Block:
    return Block(h, parent, (h,) * 32, hits)


CHAIN = {1: blk(1, None, 1), 2: blk(2, 1, 5), 3: blk(3, 2, 0), 4: blk(4, None, 3), 5: blk(5, 9, 7)}


@pytest.mark.parametrize(
    ("present", "limit", "kept"),
    [
        ({1, 2, 3, 4, 5}, 10, [1, 2, 4, 3]),  # a ranks as b (5), d 3, c 0; 5's parent 9 is gone
        ({1, 2, 3, 4, 5}, 2, [1, 2]),  # cut at the bound: whole chains only
        ({1, 2, 3, 4, 5}, 3, [1, 2, 4]),
        ({2, 3, 4}, 10, [4]),  # evicted root: its descendants cannot be matched
        ({1, 3}, 10, [1]),
        (set(), 10, []),
        ({1, 2, 3, 4}, 0, []),
    ],
)
def test_choose_keeps_the_hottest_whole_chains_parents_first(present, limit, kept):
    assert [b.hash for b in choose(CHAIN, present, limit)] == kept


def answer(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=COLD_ANSWER)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]}


def metrics(url: str) -> dict[tuple[str, str], float]:
    """(sample name, its reason label or "") → value, for the families these tests read."""
    out = {}
    text = httpx.get(f"{url}/metrics", timeout=HTTP_READ).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("vllm:prefix_cache", "stoker_engine_kv_")) and not s.name.endswith(
                "_created"
            ):
                out[(s.name, s.labels.get("reason", ""))] = s.value
    return out


def hits(url: str) -> float:
    return metrics(url).get(("vllm:prefix_cache_hits_total", ""), 0.0)


def restored(url: str) -> float:
    return metrics(url).get(("stoker_engine_kv_restored_blocks_total", ""), 0.0)


def rejected(url: str) -> dict[str, float]:
    return {
        r: v
        for (name, r), v in metrics(url).items()
        if name.startswith("stoker_engine_kv_restore_rejected") and v
    }


def kept_files(snapshot: Path) -> list[Path]:
    directory = KeptKv(snapshot.parent).snapshot_dir(snapshot.name)
    return sorted(directory.glob("*.kv")) if directory.is_dir() else []


@pytest.fixture
def scope() -> str:
    """A scope of the test's own: the session's other engines keep theirs under "tiny"."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def cold(fresh_engine) -> dict:
    """The prompt's answer from an engine that keeps and restores nothing: a cold prefill."""
    e = fresh_engine("--kv-keep-bytes", "0")
    reference = answer(e.url)
    e.stop()
    return reference


def test_a_kept_prefix_answers_as_a_cold_one_after_a_wake_and_after_a_restart(
    fresh_engine, cold, scope, tiny_snapshot
):
    before = set(kept_files(tiny_snapshot))
    e = fresh_engine("--kv-keep-scope", scope)
    assert restored(e.url) == 0 and answer(e.url) == cold and hits(e.url) == 0
    assert httpx.post(f"{e.url}/sleep?level=1", timeout=COLD_ANSWER).status_code == 200
    (path,) = set(kept_files(tiny_snapshot)) - before  # written by the sleep, under this scope's key
    assert path.stat().st_mode & 0o777 == 0o600
    assert httpx.post(f"{e.url}/wake_up", timeout=COLD_ANSWER).status_code == 200
    blocks = restored(e.url)
    assert (
        blocks >= len(PROMPT.split()) // 32
    )  # the prompt's full blocks, at least (a word is a token or more)
    assert answer(e.url) == cold
    assert hits(e.url) >= 32 * blocks  # the first request after the wake matched them all
    e.stop()  # the stop keeps them (rewritten only if the set changed)

    again = fresh_engine("--kv-keep-scope", scope)  # a new process: restored before READY
    assert restored(again.url) == blocks
    assert answer(again.url) == cold
    assert hits(again.url) >= 32 * blocks
    assert rejected(again.url) == {}


def test_a_corrupt_truncated_or_foreign_file_is_ignored_and_counted(fresh_engine, cold, scope, tiny_snapshot):
    before = set(kept_files(tiny_snapshot))
    e = fresh_engine("--kv-keep-scope", scope)
    answer(e.url)
    e.stop()
    (path,) = set(kept_files(tiny_snapshot)) - before
    good = path.read_bytes()

    other = f"{scope}-other"  # another deployment's engine on the same snapshot: none of this scope's
    theirs = fresh_engine("--kv-keep-scope", other)
    assert restored(theirs.url) == 0 and rejected(theirs.url) == {}
    assert answer(theirs.url) == cold and hits(theirs.url) == 0
    theirs.stop()
    (foreign,) = set(kept_files(tiny_snapshot)) - before - {path}

    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF
    # A flipped byte; a whole, sound file of the other scope under this one's name. (Truncated,
    # malformed, oversize and linked files: test_kept_files_are_checked_before_use, below.)
    for reason, content in {"checksum": bytes(damaged), "foreign": foreign.read_bytes()}.items():
        path.write_bytes(content)
        e = fresh_engine("--kv-keep-scope", scope)
        assert rejected(e.url) == {reason: 1.0}, reason
        assert restored(e.url) == 0
        assert answer(e.url) == cold and hits(e.url) == 0, reason
        e.stop()


def test_the_byte_bound_holds_and_keeps_whole_chains(fresh_engine, cold, scope, tiny_snapshot):
    bound = 2 * BLOCK_BYTES + 8192  # two blocks and their header
    before = set(kept_files(tiny_snapshot))
    e = fresh_engine("--kv-keep-scope", scope, "--kv-keep-bytes", str(bound))
    answer(e.url)
    e.stop()
    (path,) = set(kept_files(tiny_snapshot)) - before
    assert path.stat().st_size <= bound
    again = fresh_engine("--kv-keep-scope", scope, "--kv-keep-bytes", str(bound))
    assert restored(again.url) == 2  # the prompt's first two blocks: a prefix it still matches
    assert answer(again.url) == cold and hits(again.url) == 64
    again.stop()

    path.write_bytes(path.read_bytes() + b"\0" * (bound - path.stat().st_size + 1))
    e = fresh_engine("--kv-keep-scope", scope, "--kv-keep-bytes", str(bound))
    assert rejected(e.url) == {"oversize": 1.0}  # never read past the bound
    e.stop()


def test_kept_files_are_checked_before_use(tmp_path):
    """What a restore reads, check by check, on files the engine's own writer made
    (a stand-in for transformers' allocator: only its page size and block bytes are read)."""
    allocator = SimpleNamespace(tokens_per_page=32, bytes_per_block=64)
    keep = KvKeep(
        KeepConfig(tmp_path, "a" * 64, "s", max_bytes=4096), EngineMetrics("tiny"), "float32", "cpu"
    )
    key = {"snapshot": "a" * 64, "scope": "s"}
    root = compute_block_hash(None, list(range(32)))
    child = compute_block_hash(root, list(range(32, 64)))
    blocks = [Block(root, None, tuple(range(32)), 3), Block(child, root, tuple(range(32, 64)), 1)]
    path = tmp_path / "k.kv"

    def write(rows: list[Block], payload: bytes, header_key: dict = key) -> bytes:
        keep._write(path, keep._header(header_key, rows), payload)
        return path.read_bytes()

    good = write(blocks, bytes(range(128)))
    assert path.stat().st_mode & 0o777 == 0o600
    parsed, payload = keep._parse(keep._read(path), key, allocator)
    assert parsed == blocks and bytes(payload) == bytes(range(128))

    def reason(content: bytes | None = None) -> str:
        if content is not None:
            path.unlink()
            path.write_bytes(content)
        with pytest.raises(Rejected) as info:
            keep._parse(keep._read(path), key, allocator)
        return info.value.reason

    assert reason(good[:-1]) == "checksum"
    assert reason(good[:30]) == "truncated"
    assert reason(b"NOTKEPT!" + good[8:]) == "format"
    assert reason(write(blocks, bytes(range(128)), {**key, "scope": "t"})) == "foreign"
    assert reason(write(blocks, bytes(range(100)))) == "shape"
    assert reason(write(blocks[1:], bytes(64))) == "chain"  # a child without its parent
    tampered = [Block(root, None, tuple(range(1, 33)), 3)]  # tokens that do not hash to its name
    assert reason(write(tampered, bytes(64))) == "chain"
    assert reason(good + bytes(4096)) == "oversize"
    path.unlink()
    (tmp_path / "elsewhere").write_bytes(good)
    path.symlink_to(tmp_path / "elsewhere")
    assert reason() == "unreadable"  # a link is never followed
    path.unlink()
    assert keep._read(path) is None  # nothing kept: nothing to reject


def test_blocks_computed_under_an_adapter_are_never_kept(
    fresh_engine, cold, scope, tiny_snapshot, tiny_model_dir, tmp_path
):
    """Only base-model blocks come back: an adapter's requests publish none, so an engine that served
    the prompt only through an adapter keeps nothing, and the base's answer after it is cold."""
    adapter = tmp_path / "a1"
    build_tiny_adapter(tiny_model_dir, adapter, seed=1, rank=8)
    before = set(kept_files(tiny_snapshot))
    e = fresh_engine("--kv-keep-scope", scope, "--max-adapters", "1")
    body = {"lora_name": "a1", "lora_path": str(adapter)}
    assert httpx.post(f"{e.url}/v1/load_lora_adapter", json=body, timeout=HTTP_READ).status_code == 200
    r = httpx.post(f"{e.url}/v1/completions", json={**GREEDY, "model": "a1"}, timeout=COLD_ANSWER)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] != cold["text"]  # the adapter changes the answer
    assert httpx.post(f"{e.url}/sleep?level=1", timeout=COLD_ANSWER).status_code == 200
    assert set(kept_files(tiny_snapshot)) == before  # nothing to keep
    assert httpx.post(f"{e.url}/wake_up", timeout=COLD_ANSWER).status_code == 200
    assert restored(e.url) == 0
    assert answer(e.url) == cold and hits(e.url) == 0
