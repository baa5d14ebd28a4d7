"""The activator: holds requests while capacity comes up, picks a ready instance, streams the answer.

Per deployment, an `Activator` holds a bounded queue of requests with deadlines, picks the ready
instance with the fewest outstanding requests (`balancer.pick`), or in prefix mode the one its
prompt prefix hashes to within a load bound (`set_balance(Balance("prefix"))`, `pick_by_prefix`),
and relays the answer through an unbuffered streaming proxy (aiohttp, one shared connection pool).
It imports none of Stoker's other packages: the composition root wires it to the warm pool through
the protocols in `source.py`.

    activator = Activator("smollm2", pool, ActivatorConfig(), session, ActivatorMetrics(registry))
    await activator.serve(scope, receive, send, body, stream)   # raises ActivatorError before headers
"""

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
