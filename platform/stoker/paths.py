"""Where Stoker keeps its data on this machine.

One data dir (`$STOKER_HOME`, default `~/.local/share/stoker`) holds everything that outlives a
process: the snapshot store now, the deployment registry later.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    home = os.environ.get("STOKER_HOME")
    if home:
        return Path(home).expanduser()
    return Path("~/.local/share/stoker").expanduser()


def snapshot_store_dir() -> Path:
    return data_dir() / "snapshots"
