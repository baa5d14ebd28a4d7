"""The snapshot package's one error hierarchy.

Every failure a user can cause is one of these, with a message that fits on one line (the CLI prints
it as `stoker: error: <message>`). OS and third-party errors are translated where they enter.

    SnapshotError
    ├── InvalidSource      the thing to import is missing, of the wrong kind, or malformed
    ├── UnsafeFileError    the source holds pickled weights (unpickling runs code)
    ├── UnsafePathError    a manifest path is absolute, climbs out with `..`, or is otherwise unsafe
    ├── InvalidName        a snapshot name with characters a file name cannot safely hold
    ├── SnapshotNotFound   no snapshot matches a ref (id, id prefix or name)
    ├── AmbiguousRef       an id prefix that matches more than one snapshot
    ├── CorruptSnapshot    a stored manifest that cannot be read or does not match its id
    └── StoreWriteError    writing into the store failed (disk full, permissions); nothing was kept
"""

from __future__ import annotations


class SnapshotError(Exception):
    """Base class: anything that goes wrong with a snapshot."""


class InvalidSource(SnapshotError):
    """The import source is missing, of an unsupported kind, or not a usable model."""


class UnsafeFileError(SnapshotError):
    """The source contains pickled weights, which are never loaded."""


class UnsafePathError(SnapshotError):
    """A manifest path that could point outside the snapshot directory."""


class InvalidName(SnapshotError):
    """A snapshot name that is not a safe file name."""


class SnapshotNotFound(SnapshotError):
    """No snapshot in the store matches the given ref."""


class AmbiguousRef(SnapshotError):
    """An id prefix that matches more than one snapshot."""


class CorruptSnapshot(SnapshotError):
    """A stored snapshot whose manifest is unreadable or inconsistent."""


class StoreWriteError(SnapshotError):
    """Writing a snapshot into the store failed; the partial copy has been removed."""
