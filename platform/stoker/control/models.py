"""What a deploy's `model` (or `adapter`) names, as a snapshot id: a snapshot in the store, one in
object storage, or a local directory, GGUF file or Hugging Face cache entry imported now."""

from __future__ import annotations

import asyncio
from pathlib import Path

from snapshots import (
    SnapshotError,
    SnapshotNotFound,
    SnapshotRecord,
    SnapshotStore,
    hf_cache,
    import_gguf,
    import_hf_dir,
)
from snapshots.importer import import_adapter_dir
from snapshots.remote import read_manifest
from snapshots.s3 import RemoteConfig
from stoker.errors import invalid


async def resolve_model(store: SnapshotStore, model: str, param: str = "model") -> str:
    """The snapshot id `model` names: a snapshot in the store, a snapshot in object storage (its
    manifest is read now; the bytes are pulled before the first instance starts), or a local
    directory or GGUF file, or a Hugging Face repo id (`org/name[@revision]`) already in this
    machine's Hugging Face cache, imported now. A 400 naming `param` otherwise."""
    if model.startswith("s3://"):
        try:
            manifest = await read_manifest(model, RemoteConfig.from_env())
        except SnapshotError as exc:
            raise invalid(str(exc), param) from None
        return manifest.snapshot_id
    try:
        return store.resolve(model).id
    except SnapshotNotFound:
        pass
    except SnapshotError as exc:
        raise invalid(str(exc), param) from None
    try:
        record = await asyncio.to_thread(import_local, store, model)
    except SnapshotError as exc:
        raise invalid(str(exc), param) from None
    except OSError as exc:  # a name the filesystem cannot even look up (too long, a NUL byte's kin)
        raise invalid(f"'{param}' is no path this machine can read: {exc.strerror or exc}.", param) from None
    if record is None:
        raise invalid(
            f"Model {model!r} is neither a snapshot in the store, an s3:// snapshot, a local model "
            "directory or .gguf file, nor a Hugging Face repo id (org/name).",
            param,
        )
    return record.id


def import_local(store: SnapshotStore, model: str) -> SnapshotRecord | None:
    path = Path(model).expanduser()
    if path.is_dir() and (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        return import_adapter_dir(path, store)  # a PEFT LoRA adapter (`snapshots.adapter`)
    if path.is_dir():
        return import_hf_dir(path, store)
    if path.is_file() and path.suffix == ".gguf":
        return import_gguf(path, store)
    if not path.exists() and hf_cache.is_repo_ref(model):  # org/name: from the local HF cache only
        return import_hf_dir(hf_cache.resolve(model), store)
    return None
