"""The data dir's own files: `stoker.db` (deployments, key hashes, routes) readable by its owner
only, and the lock that keeps a second platform off a data dir in use (`stoker.paths`)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from stoker.control.keys import KeyStore
from stoker.control.registry import Registry
from stoker.control.routes import CascadeRoutes
from stoker.errors import CLIError
from stoker.paths import LOCK_NAME, lock_data_dir, open_database


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_database_and_its_wal_are_0600_whoever_opens_it_first(tmp_path):
    for opener in (Registry, KeyStore, CascadeRoutes):
        path = tmp_path / opener.__name__ / "stoker.db"
        store = opener(path)
        assert mode(path) == 0o600, opener
        for side in ("-wal", "-shm"):
            if path.with_name(path.name + side).exists():
                assert mode(path.with_name(path.name + side)) == 0o600, (opener, side)
        store.close()


def test_a_database_an_older_version_left_0644_is_narrowed(tmp_path):
    path = tmp_path / "stoker.db"
    open_database(path).close()
    for p in (path, path.with_name("stoker.db-wal")):
        p.touch()
        os.chmod(p, 0o644)
    registry = Registry(path)
    assert mode(path) == 0o600 and mode(path.with_name("stoker.db-wal")) == 0o600
    registry.close()


def test_a_link_in_the_databases_place_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere.db"
    elsewhere.write_bytes(b"")
    (tmp_path / "stoker.db").symlink_to(elsewhere)
    with pytest.raises(OSError):
        Registry(tmp_path / "stoker.db")


def test_a_second_holder_is_refused_naming_the_first_and_a_dead_ones_lock_is_free(tmp_path):
    # The first holder is another process, as a second `stoker up` meets it.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from stoker.paths import lock_data_dir; "
            "lock_data_dir(pathlib.Path(sys.argv[1]), 'test'); print('held', flush=True); sys.stdin.read()",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CLIError) as refused:
            lock_data_dir(tmp_path, "stoker up")
        message = str(refused.value)
        assert f"pid {holder.pid}" in message and str(tmp_path) in message and "\n" not in message
        assert mode(tmp_path / LOCK_NAME) == 0o600
    finally:
        holder.kill()
        holder.wait()
    fd = lock_data_dir(tmp_path, "stoker up")  # the kernel let go of the killed holder's lock
    assert os.pread(fd, 32, 0).decode().strip() == str(os.getpid())
    os.close(fd)
