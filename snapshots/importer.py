"""Importing a model into the store: from a Hugging Face layout directory or a GGUF file; or a PEFT
LoRA adapter directory (`import_adapter_dir`: a snapshot of kind "adapter", see `snapshots.adapter`).

Either way the files are written into a hidden staging dir inside the store root, hashed, listed in
a manifest, and renamed into place in one step (see `store`). Refused up front, before a byte is
written: pickled weights, symlinks leading out of the source, a directory without `config.json` or
without `*.safetensors`. Safetensors bytes are copied exactly as given; the manifest records their
dominant dtype. The copy reads each file through a descriptor opened without following symlinks and
checked to be the very file the scan approved, so swapping a file for a link to something else
while a large model copies is refused rather than copied; a stored file is never more readable
than its source.

A GGUF is converted (about half a minute for SmolLM2), so the store keeps `sources/<sha256 of the GGUF>`
-> id; importing the same file again costs one hash of it (~0.3 s for 98 MB).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from snapshots.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterInfo, adapter_info, read_adapter
from snapshots.durable import copy_hashing, hash_file
from snapshots.errors import InvalidSource, UnsafeFileError
from snapshots.manifest import MANIFEST_NAME, FileEntry, Manifest
from snapshots.store import SnapshotRecord, SnapshotStore, check_name
from snapshots.weights import dominant_dtype, is_pickle, pickle_refused

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class SourceFile:
    rel: str  # POSIX path inside the snapshot
    path: Path  # where its bytes are read from (a symlink's target, already checked)
    identity: tuple[int, int] = (0, 0)  # (dev, ino) the check approved: the copy reads this file or none
    size: int = 0


def _in_hf_cache_blobs(root: Path, target: Path) -> bool:
    """`models--org--name/snapshots/<rev>/file` links to `models--org--name/blobs/<sha>` in HF's cache.

    Those links are the cache's normal layout; any other link out of the source could copy an
    unrelated file (a key, a password file) into a snapshot that may later be pushed to a bucket.
    """
    repo = root.parent.parent
    return root.parent.name == "snapshots" and target.parent == repo / "blobs"


# A model directory holds tens of files (a sharded 405B model: a few hundred); a tree with more is
# something else, and walking it is what a hostile deploy (`"model": "/"`) would make the platform do.
MAX_ENTRIES = 10_000


def scan_hf_dir(src: Path) -> list[SourceFile]:
    """The files to import from `src`, sorted; raise if the directory is not a safe HF model.

    Hidden files and dirs (`.git`, `.cache`, `.gitattributes`) are not part of a model and are
    skipped. A symlink is followed only when it stays inside `src`, or when `src` is a revision
    of a Hugging Face cache and the link leads to that repository's blob store.
    """
    _check_dir(src)
    # Before walking anything: a deploy names its model by path, and `/` or a home directory must
    # be refused at once, not walked file by file. The walk below still checks every file.
    if not (src / "config.json").is_file():
        hint = f" (it is a LoRA adapter: {ADAPTER_CONFIG})" if (src / ADAPTER_CONFIG).is_file() else ""
        raise InvalidSource(f"{src} is not a Hugging Face model directory: it has no config.json{hint}")
    found = _walk(src)
    rels = {f.rel for f in found}
    if "config.json" not in rels:
        raise InvalidSource(f"{src} is not a Hugging Face model directory: it has no config.json")
    if not any(r.endswith(".safetensors") for r in rels):
        raise InvalidSource(f"{src} has no *.safetensors weights")
    _check_config(src / "config.json")
    return found


def scan_adapter_dir(src: Path) -> list[SourceFile]:
    """`scan_hf_dir` for a PEFT LoRA adapter: `adapter_config.json` and `adapter_model.safetensors`."""
    _check_dir(src)
    if not (src / ADAPTER_CONFIG).is_file():
        raise InvalidSource(f"{src} is not a LoRA adapter directory: it has no {ADAPTER_CONFIG}")
    found = _walk(src)  # refuses a pickled adapter_model.bin, as it refuses any pickled weights
    rels = {f.rel for f in found}
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if name not in rels:
            raise InvalidSource(f"{src} is not a LoRA adapter directory: it has no {name}")
    return found


def _check_dir(src: Path) -> None:
    if not src.exists():
        raise InvalidSource(f"no such file or directory: {src}")
    if not src.is_dir():
        raise InvalidSource(f"{src} is neither a model directory nor a .gguf file")


def _walk(src: Path) -> list[SourceFile]:
    """Every file under `src` but the hidden ones and a manifest, sorted; raise on anything unsafe."""
    root = src.resolve()
    found: list[SourceFile] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(src):
        seen += len(dirnames) + len(filenames)
        if seen > MAX_ENTRIES:
            raise InvalidSource(f"{src} holds more than {MAX_ENTRIES} entries: not a model directory")
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for d in dirnames:
            if (here / d).is_symlink():
                raise InvalidSource(
                    f"{(here / d).relative_to(src)} is a symlinked directory; copy it in instead"
                )
        for filename in sorted(f for f in filenames if not f.startswith(".")):
            path = here / filename
            rel = path.relative_to(src).as_posix()
            target = path.resolve()
            if path.is_symlink() and not (target.is_relative_to(root) or _in_hf_cache_blobs(root, target)):
                raise UnsafeFileError(
                    f"refusing {rel}: a symlink to {target}, outside {src} (copy the files with cp -L first)"
                )
            if is_pickle(rel) or is_pickle(target):
                raise pickle_refused(rel)
            try:
                st = target.stat()
            except OSError as exc:
                raise InvalidSource(f"cannot read {rel} in {src}: {exc.strerror or exc}") from exc
            if not stat.S_ISREG(st.st_mode):
                raise InvalidSource(f"{rel} in {src} is not a regular file")
            found.append(SourceFile(rel, target, (st.st_dev, st.st_ino), st.st_size))
    return [f for f in found if f.rel != MANIFEST_NAME]  # a snapshot dir given back as source


def _check_config(path: Path) -> None:
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise InvalidSource(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidSource(f"{path} is not a JSON object")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _commit(
    store: SnapshotStore,
    tmp: Path,
    entries: list[FileEntry],
    dtype: str,
    source: str,
    adapter: AdapterInfo | None = None,
) -> str:
    kind = "model" if adapter is None else "adapter"
    manifest = Manifest(
        dtype=dtype, files=tuple(entries), source=source, created=_now(), kind=kind, adapter=adapter
    )
    with open(tmp / MANIFEST_NAME, "x") as f:
        f.write(manifest.to_json())
    return store.commit(tmp)


def import_hf_dir(src: Path, store: SnapshotStore, name: str | None = None) -> SnapshotRecord:
    """Copy a Hugging Face layout directory into the store; return its record (same bytes: same id)."""
    src = Path(src)
    if name is not None:
        check_name(name)
    return _import_files(src, scan_hf_dir(src), store, name)


def import_adapter_dir(src: Path, store: SnapshotStore, name: str | None = None) -> SnapshotRecord:
    """Copy a PEFT LoRA adapter directory into the store as a snapshot of kind "adapter".

    Its config and tensor header are checked before a byte is copied (`snapshots.adapter`), and the
    record is read again from the staged copy, so it describes exactly the bytes stored.
    """
    src = Path(src)
    if name is not None:
        check_name(name)
    files = scan_adapter_dir(src)
    by_rel = {f.rel: f for f in files}
    config, weights = by_rel[ADAPTER_CONFIG], by_rel[ADAPTER_WEIGHTS]
    read_adapter(config.path, weights.path, {config.path: config.identity, weights.path: weights.identity})
    return _import_files(src, files, store, name, adapter=True)


def _import_files(
    src: Path, files: list[SourceFile], store: SnapshotStore, name: str | None, *, adapter: bool = False
) -> SnapshotRecord:
    dtype = dominant_dtype(f.path for f in files if f.rel.endswith(".safetensors"))
    store.remove_stale_tmp()
    store.make_room(sum(f.size for f in files))  # StoreFull now beats ENOSPC halfway
    with store.staging() as tmp:
        entries = []
        for f in files:
            dst = tmp / f.rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            # Through a descriptor of the very file the scan approved: a file swapped for a symlink
            # (or another file) since is refused, not copied (see `open_regular_nofollow`).
            size, digest = copy_hashing(f.path, dst, expect=f.identity)
            entries.append(FileEntry(f.rel, size, digest))
        info = adapter_info(tmp) if adapter else None
        snapshot_id = _commit(store, tmp, entries, dtype, source=str(src.resolve()), adapter=info)
    if name is not None:
        store.set_name(name, snapshot_id)
    store.touch(snapshot_id)
    return store.record(snapshot_id)


def _check_gguf(path: Path) -> None:
    if not path.exists():
        raise InvalidSource(f"no such file or directory: {path}")
    if not path.is_file():
        raise InvalidSource(f"{path} is not a file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise InvalidSource(f"cannot read {path}: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise InvalidSource(f"{path} is not a GGUF file (it does not start with 'GGUF')")


def _converted_bytes(path: Path) -> int:
    """About how many bytes converting `path` writes: its tensors as float32, plus the vocabulary.

    Reading the GGUF's tensor table costs ~5 s for SmolLM2 (next to a minute of conversion). The
    non-tensor part (vocabulary, merges) is counted 4 times over: written out as tokenizer JSON it
    grows to about twice its binary size, and an estimate that errs large only evicts a little early.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the gguf package raises ValueError, struct.error and worse on bad input
        first = str(exc).strip().splitlines()
        raise InvalidSource(
            f"cannot read {path.name} as a GGUF model: {first[0] if first else exc!r}"
        ) from exc
    return 4 * sum(int(t.n_elements) for t in reader.tensors) + 4 * int(reader.data_offset)


def import_gguf(
    path: Path,
    store: SnapshotStore,
    name: str | None = None,
    *,
    on_convert: Callable[[Path], None] | None = None,
    generation: Mapping[str, float | bool] | None = None,
) -> SnapshotRecord:
    """Convert a GGUF file to a float32 safetensors snapshot; reuse the earlier result if any.

    `on_convert(path)` is called just before a conversion starts (not when the result is reused),
    so a caller can tell its user that the next minute is expected. `generation` (e.g. temperature,
    top_p) is merged into the snapshot's generation_config.json: the sampling defaults engines apply.
    """
    path = Path(path)
    if name is not None:
        check_name(name)
    _check_gguf(path)
    store.remove_stale_tmp()
    try:
        _, source_digest = hash_file(path)
    except OSError as exc:
        raise InvalidSource(f"cannot read {path}: {exc.strerror or exc}") from exc
    if generation:  # another output from the same file: its own entry in the sources index
        settings = json.dumps(dict(generation), sort_keys=True)
        source_digest = hashlib.sha256(f"{source_digest}:{settings}".encode()).hexdigest()
    snapshot_id = store.lookup_source(source_digest)
    if snapshot_id is None:
        from snapshots.gguf_convert import convert_gguf

        store.make_room(_converted_bytes(path))
        if on_convert is not None:
            on_convert(path)
        with store.staging() as tmp:
            convert_gguf(path, tmp)
            if generation:
                config_path = tmp / "generation_config.json"
                config = json.loads(config_path.read_text()) if config_path.is_file() else {}
                config.update(generation)
                config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            files = scan_hf_dir(tmp)
            dtype = dominant_dtype(f.path for f in files if f.rel.endswith(".safetensors"))
            entries = [FileEntry(f.rel, *hash_file(f.path)) for f in files]
            snapshot_id = _commit(store, tmp, entries, dtype, source=f"gguf:{path.resolve()}")
        store.remember_source(source_digest, snapshot_id)
    if name is not None:
        store.set_name(name, snapshot_id)
    store.touch(snapshot_id)
    return store.record(snapshot_id)
