"""Where Stoker keeps its data on this machine.

One data dir (`$STOKER_HOME`, default `~/.local/share/stoker`) holds everything that outlives a
process: the deployment registry, instance records, logs, and the snapshot store, which is
`<data dir>/snapshots` unless `--store DIR` or `$STOKER_SNAPSHOT_STORE` puts it elsewhere (the
node's NVMe). The snapshot store's disk budget comes from `$STOKER_SNAPSHOT_BUDGET`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from snapshots.sizes import parse_size
from stoker.errors import CLIError

BUDGET_ENV = "STOKER_SNAPSHOT_BUDGET"
STORE_ENV = "STOKER_SNAPSHOT_STORE"


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
