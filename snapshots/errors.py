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
    ├── SnapshotPinned     a snapshot in use (pinned) cannot be removed
    ├── StoreWriteError    writing into the store failed (disk full, permissions); nothing was kept
    │   └── StoreFull          no room within the budget or on disk, even after evicting all unpinned
    └── RemoteError        object storage (S3) refused or failed a push or pull; a bad s3:// URI
        ├── RemoteNotFound     no such bucket, or no snapshot (manifest.json) at the prefix
        ├── RemoteDenied       no or wrong credentials, or access denied
        └── RemoteUnavailable  unreachable, throttled or failing (5xx), still so after our retries
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


class StoreFull(StoreWriteError):
    """No room for a new snapshot: over budget or short of disk with only pinned snapshots left to go."""


class SnapshotPinned(SnapshotError):
    """The snapshot is pinned (in use by an instance or another process) and so was not removed."""


class RemoteError(SnapshotError):
    """Object storage refused or failed a request, or an s3:// URI or transfer setting is malformed."""


class RemoteNotFound(RemoteError):
    """The bucket, or the snapshot at the prefix, does not exist."""


class RemoteDenied(RemoteError):
    """Credentials are missing or wrong, or they do not grant access."""


class RemoteUnavailable(RemoteError):
    """The store could not be reached or kept failing (throttling, 5xx) through every retry."""
