"""What each pool's policy has learned (the predictive policy's forecast, its idle-gap histogram
and its time-of-day profile; the others' windows), checkpointed (`stoker.control.checkpoint`) and
handed back to the pool of the same deployment and revision when a restart creates it.

    {"pools": [{"pool": "chat@2", "policy": "predictive", "state": {...}}]}

`pool` is `name@revision`, the revision the unit serves (an update in place, same snapshot and
engine, moves a pool to the new revision: it is saved under that one). A state is restored only
into a pool of the same policy whose settings it fits (`warm_pool.policies.checkpoint.fits`); a
deployment redeployed with another policy starts from that policy's initial state, as
`Pool.reconfigure` does. The states are read all or nothing at start; one not claimed by a pool
(its deployment could not be restored) is not written again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from stoker.control.checkpoint import fields, items, label
from stoker.spec.deployment import NAME
from warm_pool.policies import POLICIES
from warm_pool.policies.checkpoint import decode, encode
from warm_pool.policies.rules import RuledState
from warm_pool.pool import Pool

log = logging.getLogger("stoker.platform")

_MOST_POOLS = 10_000


class SavedPolicy(NamedTuple):
    policy: str
    state: RuledState


class PolicyStates:
    """The pools' policy states: `checkpoint` from the pools that run, `restore` into `take`."""

    checkpoint_kind = "policies"

    def __init__(
        self,
        pools: Callable[[], Iterable[tuple[str, Pool]]],
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._pools = pools  # (name@revision, its pool) of every unit: `Platform.pools`
        self._clock = clock
        self._wall = wall
        self._restored: dict[str, SavedPolicy] = {}

    def checkpoint(self) -> dict[str, Any]:
        to_wall = self._wall() - self._clock()
        out = []
        for key, pool in sorted(self._pools(), key=lambda kp: kp[0]):
            policy, state = pool.saved_policy()
            out.append({"pool": key, "policy": policy, "state": encode(policy, state, to_wall)})
        return {"pools": out}

    def restore(self, body: dict[str, Any]) -> None:
        to_wall = self._wall() - self._clock()
        doc = fields(body, "policies", ("pools",))
        restored: dict[str, SavedPolicy] = {}
        for i, entry in enumerate(items(doc["pools"], "policies.pools", _MOST_POOLS)):
            where = f"policies.pools[{i}]"
            e = fields(entry, where, ("pool", "policy", "state"))
            key = label(e["pool"], f"{where}.pool")
            name, _, revision = key.rpartition("@")
            if not NAME.fullmatch(name) or not revision.isdigit() or revision.startswith("0"):
                raise ValueError(f"{where}.pool: want name@revision, got {key!r}")
            if key in restored:
                raise ValueError(f"{where}.pool: {key} twice")
            policy = e["policy"]
            if policy not in POLICIES:
                raise ValueError(f"{where}.policy: {policy!r:.40} is not one this version has")
            try:
                state = decode(policy, e["state"], to_wall)
            except ValueError as exc:
                raise ValueError(f"{where} ({key}): {exc}") from None
            restored[key] = SavedPolicy(policy, state)
        self._restored = restored

    def take(self, key: str, pool: Pool) -> None:
        """Into the new pool of `key` (name@revision), the state a previous run left it, once."""
        saved = self._restored.pop(key, None)
        if saved is None:
            return
        if pool.restore_policy(saved.policy, saved.state):
            log.info("pool %s: carries on with its %s policy's learned state", key, saved.policy)
        else:
            log.info(
                "pool %s: starts its %s policy afresh (the checkpoint holds %s's state)",
                key,
                pool.policy,
                saved.policy,
            )
