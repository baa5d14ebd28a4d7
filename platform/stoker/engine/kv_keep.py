"""Warm KV across scale-to-zero: the prefix cache's hottest blocks, kept in the store over sleep and stop.

A deployment that sleeps or scales to zero lost its prefix cache: sleep resets it (`core.Engine.
_keep_manager`) and a stop takes it along, so a returning conversation (a long system prompt, a
multi-turn chat) paid its whole prefill again after every wake or start. `KvKeep` writes the
blocks transformers' prefix sharing holds, hottest first, to one file beside the snapshot when the
engine sleeps or stops, and maps them back into the cache, hashes registered, before a start or a
wake reports READY: the first request then matches them as it would on an engine that never slept.

What a block is: `page_size` tokens of K and V for every layer, one row of the cache tensor viewed
as `[blocks, bytes_per_block]`, named by transformers' hash chain (`compute_block_hash(parent,
tokens)`: a block's hash covers every token before it). The ledger maps hash → block; a block no
request holds stays there, "cached", until memory pressure evicts it. Restored blocks are put there
the same way, so a first request acquires them and pressure can still evict them.

Hits: `attach` wraps the cache's `search_prefix_match` (outside the adapter guard, so only base
requests count) to add one hit to each block a prompt matched, and `mark_complete_blocks` to learn
each new hashed block's tokens and parent. `choose` (pure) ranks blocks by their hits, a block's
rank raised to its hottest descendant's so that a parent always goes before its children: any
prefix of the ranking is a set of whole chains, and cutting it at the byte bound keeps only
reachable blocks.

The file, `<store>/kv/<snapshot id>/<key digest>.kv` (`snapshots.kept_kv` owns the directory: it
is counted, evicted and removed with the snapshot):

    b"STOKERKV" | u64 header length | header (JSON) | payload | sha256 of all that precedes

The header holds the key and, per block, its hash, its parent's and its tokens; the payload the
blocks' bytes in the header's order. The key is what changes what the bytes mean: the snapshot, the
scope (a deployment's by default: two tenants' engines on one snapshot never read each other's),
the versions of Stoker, transformers and torch, dtype, device, page size and the cache's shape. Its
sha256 names the file, and the header repeats it, so a file renamed onto another key is refused.

A restore takes nothing it has not checked: a file opened without following links, a regular file,
no larger than the bound, its checksum, its key, every block's hash recomputed from its tokens and
parent. A file that fails is ignored and counted in `stoker_engine_kv_restore_rejected{reason}`:
unreadable, oversize, truncated, format, checksum, foreign (another key), shape, chain. Writes go to
a temp file (0600, created exclusively, never through a link), fsynced, renamed over the old one.

LoRA adapters: blocks computed under an adapter are never kept. `adapters.guard_prefix_cache` keeps
adapter requests from publishing hashes at all, so every hashed block is the base model's; the
mark wrapper here indexes only requests the guard lets share (`shares`).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

from snapshots.durable import fsync_dir
from snapshots.kept_kv import DEFAULT_BYTES, TMP_PREFIX
from snapshots.owner import private_name
from stoker.engine.metrics import EngineMetrics

log = logging.getLogger("stoker.engine")

MAGIC = b"STOKERKV"
FORMAT = 1
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 64 << 20
SUFFIX = ".kv"
REASONS = ("unreadable", "oversize", "truncated", "format", "checksum", "foreign", "shape", "chain")
# Restored blocks may fill at most this share of the cache: the rest is for the requests that follow.
RESTORE_SHARE = 0.5


class Rejected(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class KeepConfig:
    """Where and how much KV an engine keeps. `directory`: its snapshot's dir of kept KV in the store."""

    directory: Path
    snapshot_id: str
    scope: str  # who may read what it keeps: a deployment's name unless the deployment shares wider
    max_bytes: int = DEFAULT_BYTES

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"kv keep bytes must be at least 1, got {self.max_bytes}")
        if not self.scope:
            raise ValueError("kv keep scope must not be empty")


@dataclass
class Block:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    hits: int = 0


def choose(blocks: dict[int, Block], present: Iterable[int], limit: int) -> list[Block]:
    """The at most `limit` blocks to keep, parents before children, hottest chains first.

    Only blocks in `present` (the ledger's hashes now) whose whole chain is present are reachable by a
    prefix match. A block ranks by its own hits or its hottest descendant's, whichever is more, then
    by depth: a parent never ranks below its child. Worked example, chain a → b → c with hits 1, 5, 0
    and a lone d with 3: ranks a 5, b 5, c 0, d 3; order a, b, d, c; with limit 2: a, b.
    """
    present = set(present)
    depth: dict[int, int] = {}

    def depth_of(h: int) -> int:  # -1: a block of its chain is gone
        path = []
        while h not in depth:
            block = blocks.get(h)
            if block is None or h not in present:
                depth[h] = -1
            elif block.parent is None:
                depth[h] = 0
            else:
                path.append(h)
                h = block.parent
        d = depth[h]
        for node in reversed(path):
            d = -1 if d < 0 else d + 1
            depth[node] = d
        return d

    reachable = [b for h, b in blocks.items() if h in present and depth_of(h) >= 0]
    rank = {b.hash: b.hits for b in reachable}
    for b in sorted(reachable, key=lambda b: -depth[b.hash]):  # deepest first: children raise parents
        if b.parent is not None:
            rank[b.parent] = max(rank[b.parent], rank[b.hash])
    ordered = sorted(reachable, key=lambda b: (-rank[b.hash], depth[b.hash], b.hash))
    out, taken = [], set()
    for b in ordered:
        if len(out) >= limit:
            break
        if b.parent is None or b.parent in taken:
            out.append(b)
            taken.add(b.hash)
    return out


@functools.cache
def versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {"stoker": version("stoker"), "transformers": version("transformers"), "torch": torch.__version__}


class KvKeep:
    """One engine's kept KV: `attach` to its cache, `save` on sleep and stop, `restore` before READY.

    With no `config` it keeps nothing and only counts prefix-cache queries and hits."""

    def __init__(self, config: KeepConfig | None, metrics: EngineMetrics, dtype: str, device: str) -> None:
        self.config = config
        self.metrics = metrics
        self._identity = {"dtype": dtype, "device": device}
        self._index: dict[int, Block] = {}  # hash → its tokens, parent and hits (the live ledger's, mostly)
        self._on_disk: tuple[int, ...] = ()  # the blocks the file held when this engine last read or wrote it
        self.last_restored = 0

    # ---- the cache's shape, and the key ------------------------------------------------------------

    @staticmethod
    def allocator_of(cache):
        """The cache's one allocator, when this cache is one `KvKeep` can keep: prefix sharing on, one
        attention type, the ledger and the flat cache tensor it knows. None otherwise."""
        allocators = getattr(cache, "cache_allocators", None)
        if not getattr(cache, "use_prefix_sharing", False) or not isinstance(allocators, dict):
            return None
        if len(allocators) != 1 or not isinstance(getattr(cache, "cache_tensor", None), torch.Tensor):
            return None
        allocator = next(iter(allocators.values()))
        ledger = getattr(allocator, "ledger", None)
        if not all(hasattr(ledger, a) for a in ("hash_to_block", "block_to_hash", "cached_blocks")):
            return None
        return allocator

    def key(self, cache) -> dict:
        allocator = self.allocator_of(cache)
        return {
            "format": FORMAT,
            "snapshot": self.config.snapshot_id,
            "scope": self.config.scope,
            "versions": versions(),
            **self._identity,
            "allocator": type(allocator).__name__,
            "layers": list(allocator.layer_indices),
            "kv_heads": getattr(allocator, "num_key_value_heads", None),
            "head_dim": getattr(allocator, "head_dim", None),
            "page_size": allocator.tokens_per_page,
            "bytes_per_block": allocator.bytes_per_block,
        }

    @staticmethod
    def digest(key: dict) -> str:
        text = json.dumps(key, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()

    # ---- hits and tokens, as requests run ----------------------------------------------------------

    def attach(self, cache, shares: Callable[[str], bool]) -> bool:
        """Count prefix hits and learn each hashed block's tokens (once per cache). False: not keepable."""
        allocator = self.allocator_of(cache)
        if allocator is None:
            return False
        if getattr(cache, "_stoker_kv_keep", None) is self:
            return True
        search, mark = cache.search_prefix_match, cache.mark_complete_blocks
        page, ledger, index, metrics = allocator.tokens_per_page, allocator.ledger, self._index, self.metrics
        keeps = self.config is not None

        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            matched = search(request_id, prompt_ids)
            metrics.prefix_cache(len(prompt_ids), matched)
            for block_id in allocator.block_table.get(request_id, [])[: matched // page]:
                if (block := index.get(ledger.block_to_hash.get(block_id))) is not None:
                    block.hits += 1
            return matched

        def mark_complete_blocks(state, complete_blocks) -> None:
            mark(state, complete_blocks)
            if not keeps or not complete_blocks or not shares(state.request_id):
                return
            tokens, parent = None, None
            for i, block_id in enumerate(allocator.block_table.get(state.request_id, [])):
                h = ledger.block_to_hash.get(block_id)
                if h is None:
                    break
                if h not in index:
                    tokens = tokens or state.initial_tokens + state.generated_tokens
                    index[h] = Block(h, parent, tuple(tokens[i * page : (i + 1) * page]))
                parent = h
            if len(index) > 4 * max(allocator.num_blocks, 1):  # bounded: forget what the ledger forgot
                for h in [h for h in index if h not in ledger.hash_to_block]:
                    del index[h]

        cache.search_prefix_match = search_prefix_match
        cache.mark_complete_blocks = mark_complete_blocks
        cache._stoker_kv_keep = self
        return True

    # ---- save ---------------------------------------------------------------------------------------

    def save(self, cache) -> int:
        """Write the hottest blocks the cache holds now (call with the manager stopped). Returns how
        many it wrote; 0 leaves the file as it was: nothing to keep (an engine asleep since its last
        save), or the same blocks the file holds (a wake that served no new prefix)."""
        allocator = self.allocator_of(cache)
        if allocator is None or self.config is None:
            return 0
        ledger, bpb = allocator.ledger, allocator.bytes_per_block
        # Per block: its bytes and, in the header, its hashes and tokens (~12 characters a token).
        per_block = bpb + 64 + 12 * allocator.tokens_per_page
        limit = (self.config.max_bytes - 4096) // per_block
        chosen = choose(self._index, ledger.hash_to_block, max(limit, 0))
        if not chosen:
            return 0
        key = self.key(cache)
        header = self._header(key, chosen)
        while (
            chosen and len(MAGIC) + 8 + len(header) + len(chosen) * bpb + DIGEST_BYTES > self.config.max_bytes
        ):
            chosen.pop()  # the last is nobody's parent: the rest stays whole chains
            header = self._header(key, chosen)
        if not chosen:
            return 0
        path = self.config.directory / f"{self.digest(key)}{SUFFIX}"
        if tuple(b.hash for b in chosen) == self._on_disk and path.is_file():
            return 0  # the same blocks as the file holds (a wake with no new prefix): not written again
        ids = torch.tensor([ledger.hash_to_block[b.hash] for b in chosen], dtype=torch.long)
        rows = self._rows(cache, allocator)
        payload = rows.index_select(0, ids.to(rows.device)).cpu().contiguous().numpy().tobytes()
        self._write(path, header, payload)
        self._on_disk = tuple(b.hash for b in chosen)
        self.metrics.kv_kept(len(chosen))
        return len(chosen)

    @staticmethod
    def _header(key: dict, blocks: list[Block]) -> bytes:
        body = {"key": key, "blocks": [[b.hash, b.parent, list(b.tokens), b.hits] for b in blocks]}
        return json.dumps(body, separators=(",", ":")).encode()

    @staticmethod
    def _rows(cache, allocator) -> torch.Tensor:
        """The cache tensor as one row of bytes per block: what block id i names (transformers copies
        blocks through the same view, `CacheAllocator._copy_view`)."""
        return cache.cache_tensor.view(-1, allocator.bytes_per_block)

    def _write(self, path: Path, header: bytes, payload: bytes) -> None:
        directory = path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = directory / private_name(TMP_PREFIX)  # a crashed writer's is found by gc (`kept_kv`)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as f:
                for part in (MAGIC, struct.pack("<Q", len(header)), header, payload):
                    digest.update(part)
                    f.write(part)
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(directory)

    # ---- restore ------------------------------------------------------------------------------------

    def restore(self, cache) -> int:
        """Map the kept blocks back into an empty cache and register their hashes (call before READY,
        no request running). Returns how many; a file that fails a check is counted and ignored."""
        self.last_restored = 0
        allocator = self.allocator_of(cache)
        if allocator is None or self.config is None or allocator.ledger.hash_to_block:  # or warm already
            return 0
        key = self.key(cache)
        path = self.config.directory / f"{self.digest(key)}{SUFFIX}"
        try:
            data = self._read(path)
            if data is None:
                return 0
            blocks, payload = self._parse(data, key, allocator)
        except Rejected as exc:
            self.metrics.kv_rejected(exc.reason)
            log.warning("kept KV %s ignored (%s): %s", path.name, exc.reason, exc)
            return 0
        self.last_restored = self._place(cache, allocator, blocks, payload)
        self._on_disk = tuple(b.hash for b in blocks)
        self.metrics.kv_restored(self.last_restored)
        return self.last_restored

    def _read(self, path: Path) -> bytearray | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            reason = "a link" if exc.errno == errno.ELOOP else exc.strerror
            raise Rejected("unreadable", f"cannot open it: {reason}") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise Rejected("unreadable", "not a regular file")
            if st.st_size > self.config.max_bytes:
                raise Rejected(
                    "oversize", f"{st.st_size} bytes, more than the bound of {self.config.max_bytes}"
                )
            data = bytearray(st.st_size)  # writable: the blocks are copied out of it without another copy
            view, got = memoryview(data), 0
            try:
                while got < len(data) and (n := f.readinto(view[got:])):
                    got += n
            except OSError as exc:
                raise Rejected("unreadable", exc.strerror or str(exc)) from None
            return data[:got] if got < len(data) else data

    @staticmethod
    def _parse(data: bytearray, key: dict, allocator) -> tuple[list[Block], memoryview]:
        head = len(MAGIC) + 8
        if len(data) < head + DIGEST_BYTES:
            raise Rejected("truncated", f"{len(data)} bytes")
        if data[: len(MAGIC)] != MAGIC:
            raise Rejected("format", "not a kept-KV file")
        (header_len,) = struct.unpack_from("<Q", data, len(MAGIC))
        if header_len > MAX_HEADER_BYTES or head + header_len + DIGEST_BYTES > len(data):
            raise Rejected("truncated", f"a header of {header_len} bytes in a file of {len(data)}")
        if hashlib.sha256(memoryview(data)[:-DIGEST_BYTES]).digest() != data[-DIGEST_BYTES:]:
            raise Rejected("checksum", "its bytes do not match their sha256")
        try:
            header = json.loads(bytes(memoryview(data)[head : head + header_len]))
            found, rows = header["key"], header["blocks"]
            blocks = [
                Block(int(h), None if p is None else int(p), tuple(map(int, t)), int(n))
                for h, p, t, n in rows
            ]
        except (ValueError, TypeError, KeyError) as exc:
            raise Rejected("format", f"its header does not parse: {exc}") from None
        if found != key:
            differ = sorted(k for k in set(found) | set(key) if found.get(k) != key.get(k))
            raise Rejected("foreign", f"kept under another key ({', '.join(differ)} differ)")
        bpb, page = allocator.bytes_per_block, allocator.tokens_per_page
        payload = memoryview(data)[head + header_len : -DIGEST_BYTES]
        if len(payload) != len(blocks) * bpb:
            raise Rejected("shape", f"{len(payload)} bytes of blocks for {len(blocks)} of {bpb}")
        seen: set[int] = set()
        for b in blocks:  # each a full page whose hash is transformers' of its parent and tokens
            if len(b.tokens) != page or (b.parent is not None and b.parent not in seen):
                raise Rejected("chain", f"block {b.hash:016x} is not a whole page after its parent")
            if compute_block_hash(b.parent, list(b.tokens)) != b.hash:
                raise Rejected("chain", f"block {b.hash:016x}'s hash is not its tokens'")
            seen.add(b.hash)
        return blocks, payload

    def _place(self, cache, allocator, blocks: list[Block], payload: memoryview) -> int:
        """Blocks from the pool, their bytes written, their hashes in the ledger as cached blocks."""
        pool, index, ledger = cache.pool, allocator.index, allocator.ledger
        n = min(len(blocks), int(allocator.num_blocks * RESTORE_SHARE))
        missing = n - pool.count_free_blocks(index)
        if missing > 0:
            per_sector = allocator.blocks_per_sector
            sectors = min(-(-missing // per_sector), pool.num_free_sectors)
            for _ in range(sectors):
                pool.allocate_sector(index)
            n = min(n, pool.count_free_blocks(index))
        if n <= 0:
            return 0
        ids = pool.get_free_blocks(index, n)
        bpb = allocator.bytes_per_block
        rows = self._rows(cache, allocator)
        source = torch.frombuffer(payload[: n * bpb], dtype=torch.uint8).view(n, bpb)
        rows.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=rows.device), source.to(rows.device))
        for block_id, block in zip(ids, blocks[:n], strict=True):
            if ledger.register_new_hash(block_id, block.hash) is not None:  # a duplicate in the file
                pool.free_blocks(index, [block_id])
                continue
            ledger.cached_blocks[block_id] = None  # held by no request: matched, or evicted under pressure
            self._index[block.hash] = block
        return n
