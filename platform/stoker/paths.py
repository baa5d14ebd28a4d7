"""Where Stoker keeps its data on this machine.

One data dir (`$STOKER_HOME`, default `~/.local/share/stoker`) holds everything that outlives a
process: the deployment registry, instance records, logs, and the snapshot store, which is
`<data dir>/snapshots` unless `--store DIR` or `$STOKER_SNAPSHOT_STORE` puts it elsewhere (the
node's NVMe). The snapshot store's disk budget comes from `$STOKER_SNAPSHOT_BUDGET`.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import sqlite3
import stat
from pathlib import Path

from snapshots.sizes import parse_size
from stoker.errors import CLIError

BUDGET_ENV = "STOKER_SNAPSHOT_BUDGET"
STORE_ENV = "STOKER_SNAPSHOT_STORE"
LOCK_NAME = "platform.lock"


def data_dir() -> Path:
    home = os.environ.get("STOKER_HOME")
    if home:
        return Path(home).expanduser()
    return Path("~/.local/share/stoker").expanduser()


def snapshot_store_dir() -> Path:
    store = os.environ.get(STORE_ENV, "").strip()
    return Path(store).expanduser() if store else data_dir() / "snapshots"


def add_store_args(parser: argparse.ArgumentParser) -> None:
    """`--store DIR` on a command; `stoker.cli.main` exports it as $STOKER_SNAPSHOT_STORE, so the engine
    processes a platform starts use the same store."""
    parser.add_argument(
        "--store",
        metavar="DIR",
        default=argparse.SUPPRESS,  # on a group and its subcommands alike: a later default must not undo it
        help=f"the snapshot store (default ${STORE_ENV}, else $STOKER_HOME/snapshots)",
    )


def use_store(store: str | None) -> None:
    if store is not None:
        if not store.strip():
            raise CLIError("--store: give a directory")
        os.environ[STORE_ENV] = str(Path(store).expanduser().resolve())


def snapshot_budget(value: str | None = None) -> int | None:
    """The snapshot store's disk budget in bytes: `value` (a --budget flag) or $STOKER_SNAPSHOT_BUDGET.

    Both take bytes or sizes such as `50G` and `512MiB`; unset or empty means no budget (only the
    free disk limits the store). A bad value is a CLIError that names where it came from.
    """
    where = "--budget"
    if value is None:
        value, where = os.environ.get(BUDGET_ENV, ""), BUDGET_ENV
        if not value.strip():
            return None
    try:
        budget = parse_size(value)
    except ValueError as exc:
        raise CLIError(f"{where}: {exc}") from None
    if budget < 1:
        raise CLIError(
            f"{where}: {value!r} is no room at all; give a positive size, or unset it for no budget"
        )
    return budget


def lock_data_dir(directory: Path, what: str) -> int:
    """The data dir taken for this process (`stoker up`, `stoker controller`): an exclusive `flock`
    on `<data dir>/platform.lock`, held until the process ends (however it ends: the kernel lets go
    of a dead process's lock), its PID written in the file. The registry, the instance records and
    the warm runtimes assume one owner: a second platform on the same data dir would kill the
    first one's runtimes and adopt its engines. So it is refused, naming the first one's PID.
    The descriptor is not inherited (engines outlive a killed platform: they must not hold the
    lock). Returns it, to keep open."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CLIError(f"{path} is a symbolic link: refusing to lock through it") from None
        raise CLIError(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise CLIError(
            f"the data dir {directory} is in use by another Stoker platform (pid {holder}): stop it, "
            f"or give this {what} a data dir of its own (STOKER_HOME)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def private_file(path: Path) -> None:
    """`path` made a regular file only its owner may read or write (0600), created if missing,
    never through a symbolic link; a file left wider by an older version is narrowed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def open_database(path: Path) -> sqlite3.Connection:
    """The platform's SQLite file (`stoker.db`: the deployments, the key hashes, the routes),
    autocommit, in WAL mode, 0600 (SQLite gives its -wal and -shm files the database's own mode;
    ones an older version left wider are narrowed too)."""
    private_file(path)
    for side in ("-wal", "-shm"):
        if path.with_name(path.name + side).exists():
            private_file(path.with_name(path.name + side))
    db = sqlite3.connect(path, isolation_level=None)  # autocommit; `with` for transactions
    db.execute("PRAGMA journal_mode=WAL")
    return db
