"""Where Stoker keeps its data on this machine.

One data dir (`$STOKER_HOME`, default `~/.local/share/stoker`) holds everything that outlives a
process: the snapshot store now, the deployment registry later. The snapshot store's disk budget
comes from `$STOKER_SNAPSHOT_BUDGET`.
"""

from __future__ import annotations

import os
from pathlib import Path

from snapshots.sizes import parse_size
from stoker.errors import CLIError

BUDGET_ENV = "STOKER_SNAPSHOT_BUDGET"


def data_dir() -> Path:
    home = os.environ.get("STOKER_HOME")
    if home:
        return Path(home).expanduser()
    return Path("~/.local/share/stoker").expanduser()


def snapshot_store_dir() -> Path:
    return data_dir() / "snapshots"


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
