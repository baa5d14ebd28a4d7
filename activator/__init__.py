"""The activator: holds requests while capacity comes up, picks a ready instance, streams the answer.

Per deployment, an `Activator` holds a bounded queue of requests with deadlines, picks the ready
instance with the fewest outstanding requests (`balancer.pick`), or in prefix mode the one its
prompt prefix hashes to within a load bound (`set_balance(Balance("prefix"))`, `pick_by_prefix`),
and relays the answer through an unbuffered streaming proxy (aiohttp, one shared connection pool).
It imports none of Stoker's other packages: the composition root wires it to the warm pool through
the protocols in `source.py`.

    activator = Activator("smollm2", pool, ActivatorConfig(), session, ActivatorMetrics(registry))
    await activator.serve(scope, receive, send, body, stream)   # raises ActivatorError before headers

Its names are loaded on first use (PEP 562), so a process that needs only the light parts (the
balance modes, the config, the errors: the CLI's spec checks) does not import aiohttp and the proxy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_WHERE = {
    "Activator": "activator.activator",
    "Balance": "activator.affinity",
    "pick": "activator.balancer",
    "pick_by_prefix": "activator.balancer",
    "ActivatorConfig": "activator.config",
    "ActivatorError": "activator.errors",
    "DeadlineExceeded": "activator.errors",
    "NoCapacity": "activator.errors",
    "QueueFull": "activator.errors",
    "Unavailable": "activator.errors",
    "UpstreamError": "activator.errors",
    "ActivatorMetrics": "activator.metrics",
    "Endpoint": "activator.source",
    "InstanceSource": "activator.source",
    "Load": "activator.source",
}
__all__ = [
    "Activator",
    "ActivatorConfig",
    "ActivatorError",
    "ActivatorMetrics",
    "Balance",
    "DeadlineExceeded",
    "Endpoint",
    "InstanceSource",
    "Load",
    "NoCapacity",
    "QueueFull",
    "Unavailable",
    "UpstreamError",
    "pick",
    "pick_by_prefix",
]

if TYPE_CHECKING:
    from activator.activator import Activator
    from activator.affinity import Balance
    from activator.balancer import pick, pick_by_prefix
    from activator.config import ActivatorConfig
    from activator.errors import (
        ActivatorError,
        DeadlineExceeded,
        NoCapacity,
        QueueFull,
        Unavailable,
        UpstreamError,
    )
    from activator.metrics import ActivatorMetrics
    from activator.source import Endpoint, InstanceSource, Load


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'activator' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once
    return value
