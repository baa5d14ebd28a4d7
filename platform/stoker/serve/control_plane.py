"""What the two shapes that run the control plane (`stoker up`, `stoker controller`) build alike:
the `Platform` from its settings, the checkpoints of what it learns (in its data dir, or on a
cluster in ConfigMaps), and the keys' store with the access it gives (on a cluster, Secrets). A `stoker gateway` never imports this (its keys are the controller's, synced:
`stoker.gateway.plane`)."""

from __future__ import annotations

import logging
from typing import Any

from stoker.control.checkpoint import DIR, Checkpointed, Checkpoints, CheckpointStore, FileCheckpointStore
from stoker.control.keys import KeyStore
from stoker.control.platform import Platform
from stoker.gateway.keys import Access
from stoker.http import own_hosts, own_origins
from stoker.paths import data_dir, snapshot_store_dir
from stoker.serve.options import Listen, PlatformSettings
from stoker.spec.keys import Limits

log = logging.getLogger("stoker.up")


def platform_of(settings: PlatformSettings, **wiring: Any) -> Platform:
    """The platform over $STOKER_HOME and its snapshot store; `wiring` is what the shape adds (the
    activator's config, its backend, `controller=True` ...)."""
    return Platform(data_dir(), store_dir=snapshot_store_dir(), **settings.platform_kwargs(), **wiring)


def access_of(listen: Listen, limits: Limits, keys: Any = None) -> Access:
    """The admin key, the tenant keys' store (`keys`; by default `$STOKER_HOME/stoker.db`), this
    process's own origins (for the admin API's browser guard) and the keys' default limits. Without
    an admin key the log says loudly what is open. On a cluster `keys` are the Secrets
    (`stoker.control.kube.keys`), not listed yet: how many there are is not known here."""
    listed = keys is None
    if keys is None:
        keys = KeyStore(data_dir() / "stoker.db")
    if listen.admin_key is None:
        if not listed:
            log.warning(
                "no STOKER_ADMIN_KEY: the admin API is open to anyone who can reach %s:%d, and so is every "
                "model while no tenant key's Secret (labelled stoker.dev/key) is in the namespace. Set "
                "STOKER_ADMIN_KEY to require keys.",
                listen.host,
                listen.port,
            )
        elif len(keys) == 0:
            log.warning(
                "OPEN MODE: no STOKER_ADMIN_KEY and no API keys; anyone who can reach %s:%d may deploy "
                "and call every model. Set STOKER_ADMIN_KEY to require keys.",
                listen.host,
                listen.port,
            )
        else:
            log.warning(
                "no STOKER_ADMIN_KEY: /v1 takes the %d API key(s), but the admin API is open to anyone "
                "who can reach %s:%d",
                len(keys),
                listen.host,
                listen.port,
            )
    return Access(
        listen.admin_key, keys, own_origins(listen.host, listen.port), limits, own_hosts(listen.host)
    )


def checkpoints_of(
    platform: Platform, history: Checkpointed, interval_s: float | None, store: CheckpointStore | None = None
) -> Checkpoints | None:
    """The checkpoints of what the platform learns (cost, the dashboard's `history`, the pools'
    policy states), written every `interval_s` to `store`: by default files in its data dir
    (`stoker up`, a controller on the local backend); a controller on Kubernetes, which has no
    volume, passes its ConfigMaps (`stoker.control.kube.checkpoints`). None for none
    (`--checkpoint-interval off`)."""
    if interval_s is None:
        return None
    store = store if store is not None else FileCheckpointStore(platform.data_dir / DIR)
    return Checkpoints(store, [platform.cost, history, platform.policy_states], interval_s)
