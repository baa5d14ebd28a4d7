"""Model snapshots: import from a source, a content-addressed local store, integrity checks.

A snapshot is a directory in Hugging Face layout plus `manifest.json` (every file's size and
sha256, and the weights' dtype); its id is the hash of that content, so a revision points at exact
bytes. This package is a leaf: it imports nothing else of Stoker's.

    store = SnapshotStore(root)
    record = store.resolve("smollm2")      # name, full id, or id prefix of 8+ hex chars
    record.path, record.dtype              # the dir to hand an engine; "float32", "bfloat16", ...
    record.kind, record.adapter            # "model", or "adapter" with its AdapterInfo (base, rank, shapes)
    base_mismatch(record.adapter, config)  # None if the adapter fits a base's config.json; else why not
    pagecache.warm(record.path)            # the page-cache tier: the next load runs at memory speed

Object storage lives in `snapshots.remote` (`push`, `pull`, `read_manifest`, `RemoteConfig`),
imported on demand: aiobotocore costs most of a second to import, which nothing else should pay.
"""

from snapshots.adapter import AdapterInfo, adapter_info, base_mismatch, is_adapter_dir
from snapshots.builtin import BUILTINS, builtin_path
from snapshots.errors import (
    AmbiguousRef,
    CorruptSnapshot,
    InvalidName,
    InvalidSource,
    RemoteDenied,
    RemoteError,
    RemoteNotFound,
    RemoteUnavailable,
    SnapshotError,
    SnapshotNotFound,
    StoreWriteError,
    UnsafeFileError,
    UnsafePathError,
)
from snapshots.importer import import_adapter_dir, import_gguf, import_hf_dir
from snapshots.manifest import MANIFEST_NAME, FileEntry, Manifest
from snapshots.pagecache import WarmReport
from snapshots.store import SnapshotRecord, SnapshotStore
from snapshots.verify import Problem

__all__ = [
    "BUILTINS",
    "MANIFEST_NAME",
    "AdapterInfo",
    "AmbiguousRef",
    "CorruptSnapshot",
    "FileEntry",
    "InvalidName",
    "InvalidSource",
    "Manifest",
    "Problem",
    "RemoteDenied",
    "RemoteError",
    "RemoteNotFound",
    "RemoteUnavailable",
    "SnapshotError",
    "SnapshotNotFound",
    "SnapshotRecord",
    "SnapshotStore",
    "StoreWriteError",
    "UnsafeFileError",
    "UnsafePathError",
    "WarmReport",
    "adapter_info",
    "base_mismatch",
    "builtin_path",
    "import_adapter_dir",
    "import_gguf",
    "import_hf_dir",
    "is_adapter_dir",
]
