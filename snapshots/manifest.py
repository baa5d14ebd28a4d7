"""The manifest: what a snapshot holds, and the id derived from it.

`manifest.json` sits beside the model files and lists every other file's relative path, size and
sha256, plus the weights' dtype and the format version. Those three content fields, and only
those, are hashed into the snapshot id:

    id = sha256(canonical JSON of {"version", "dtype", "files"})
    canonical = keys sorted, no whitespace, ASCII only, files sorted by path

so the same bytes always give the same id, whatever they are called or wherever they came from.
`source` and `created` are kept in the file for people and tools but stay out of the id.

`kind` is "model" or "adapter" (a PEFT LoRA adapter, see `snapshots.adapter`); a manifest written
before the field existed reads as a model. An adapter's manifest also holds `adapter` (base model,
rank, alpha, targets, base shape fingerprint), and for adapters only, `kind` and `adapter` join the
hashed content: a model's id is what it always was, and an adapter's record cannot be edited (or
an adapter passed off as a model) without its id changing. Those fields are derived from the
files, so the same adapter bytes still give the same id.

Parsing is strict: a manifest is data from disk that may have been tampered with, and its paths are
later joined onto the snapshot directory, so a path that could leave that directory is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from snapshots.adapter import AdapterInfo
from snapshots.errors import CorruptSnapshot, UnsafePathError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
KINDS = ("model", "adapter")

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def check_relative_path(path: object) -> str:
    """Return `path` if it is a safe relative POSIX path inside a snapshot; raise otherwise."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"unsafe path in manifest: {path!r} (empty or not a string)")
    if "\\" in path or "\0" in path:
        raise UnsafePathError(f"unsafe path in manifest: {path!r} (backslash or NUL)")
    if PurePosixPath(path).is_absolute():
        raise UnsafePathError(f"unsafe path in manifest: {path!r} (absolute)")
    parts = path.split("/")
    if ".." in parts:
        raise UnsafePathError(f"unsafe path in manifest: {path!r} (contains '..')")
    if any(part in ("", ".") for part in parts):
        raise UnsafePathError(f"unsafe path in manifest: {path!r} (empty or '.' component)")
    if path == MANIFEST_NAME:
        raise UnsafePathError(f"unsafe path in manifest: {path!r} (the manifest cannot list itself)")
    return path


@dataclass(frozen=True)
class FileEntry:
    """One file of a snapshot: its path relative to the snapshot dir, size and sha256 hex."""

    path: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        check_relative_path(self.path)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise CorruptSnapshot(f"bad size for {self.path!r} in manifest: {self.size!r}")
        if not isinstance(self.sha256, str) or not _SHA256_HEX.fullmatch(self.sha256):
            raise CorruptSnapshot(f"bad sha256 for {self.path!r} in manifest: {self.sha256!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    """A snapshot's content (version, dtype, files; an adapter's record) plus metadata that is not hashed."""

    dtype: str
    files: tuple[FileEntry, ...]
    version: int = FORMAT_VERSION
    source: str = field(default="", compare=False)
    created: str = field(default="", compare=False)
    kind: str = "model"
    adapter: AdapterInfo | None = None  # set exactly when kind is "adapter"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CorruptSnapshot(f"bad kind in manifest: {self.kind!r} (expected one of {', '.join(KINDS)})")
        if (self.kind == "adapter") != (self.adapter is not None):
            raise CorruptSnapshot(
                f"manifest of kind {self.kind!r} with{'out' if self.adapter is None else ''} "
                "an adapter record"
            )
        if self.version != FORMAT_VERSION:
            raise CorruptSnapshot(
                f"unsupported manifest version {self.version!r} (expected {FORMAT_VERSION})"
            )
        if not isinstance(self.dtype, str) or not self.dtype:
            raise CorruptSnapshot(f"bad dtype in manifest: {self.dtype!r}")
        files = tuple(sorted(self.files, key=lambda e: e.path))
        for a, b in itertools.pairwise(files):
            if a.path == b.path:
                raise CorruptSnapshot(f"file listed twice in manifest: {a.path!r}")
        object.__setattr__(self, "files", files)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files)

    def canonical_bytes(self) -> bytes:
        """The exact bytes hashed into the id: content fields only, in canonical JSON."""
        content = {"version": self.version, "dtype": self.dtype, "files": [e.to_dict() for e in self.files]}
        if self.adapter is not None:
            content |= {"kind": self.kind, "adapter": self.adapter.to_dict()}
        return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @property
    def snapshot_id(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def to_json(self) -> str:
        """The text of manifest.json: content and metadata, indented for people to read."""
        doc = {
            "version": self.version,
            "dtype": self.dtype,
            "source": self.source,
            "created": self.created,
            "files": [e.to_dict() for e in self.files],
            "kind": self.kind,
        }
        if self.adapter is not None:
            doc["adapter"] = self.adapter.to_dict()
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate manifest.json; UnsafePathError or CorruptSnapshot if it is not sound."""
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptSnapshot(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise CorruptSnapshot("manifest is not a JSON object")
        files = doc.get("files")
        if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
            raise CorruptSnapshot("manifest 'files' is not a list of objects")
        entries = []
        for f in files:
            check_relative_path(f.get("path"))
            entries.append(FileEntry(path=f["path"], size=f.get("size"), sha256=f.get("sha256")))
        source, created = doc.get("source", ""), doc.get("created", "")
        if not isinstance(source, str) or not isinstance(created, str):
            raise CorruptSnapshot("manifest 'source' and 'created' must be strings")
        kind = doc.get("kind", "model")
        adapter = AdapterInfo.from_dict(doc["adapter"]) if "adapter" in doc else None
        return cls(
            dtype=doc.get("dtype"),
            files=tuple(entries),
            version=doc.get("version"),
            source=source,
            created=created,
            kind=kind,
            adapter=adapter,
        )
