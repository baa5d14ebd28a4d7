"""Who wrote a hidden working dir of the store, and whether it is gone.

Temp dirs of imports and the compile caches' working copies are named `<prefix><host>-<pid>-<rnd>`:
a dir is stale when its writer, a process on this host, no longer runs. Judged by pid, not by age:
a multi-GB copy leaves a dir's mtime untouched for minutes. Another host's or container's pids mean
nothing here, so only this host's dirs are judged; a reused pid merely keeps a dead dir until that
process exits too, which costs disk, never data.
"""

from __future__ import annotations

import os
import re
import secrets
import socket


def host_tag() -> str:
    # No '-' in the tag, so a dir name splits unambiguously into host, pid and random part.
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def private_name(prefix: str) -> str:
    """A name no other writer uses: this host, this process, a random part."""
    return f"{prefix}{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_stale(name: str, prefix: str) -> bool:
    """`name` is `<prefix><this host>-<pid>-<rnd>` and that process is gone."""
    if not name.startswith(prefix):
        return False
    parts = name[len(prefix) :].split("-")
    if len(parts) != 3 or parts[0] != host_tag() or not parts[1].isdigit():
        return False
    return not pid_alive(int(parts[1]))
