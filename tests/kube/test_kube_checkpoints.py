"""`stoker.control.kube.checkpoints`: checkpoints in ConfigMaps of the fake API server, over real
HTTP, as the controller's service account (the chart's RBAC). The store's calls block, so each runs
in a thread (`asyncio.to_thread`, as `Checkpoints` makes them): the fake answers on this loop."""

from __future__ import annotations

import asyncio
import base64
import gzip
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from stoker.control.checkpoint import MAX_BYTES, CheckpointRefused, Checkpoints, FileCheckpointStore
from stoker.control.kube.checkpoints import KEY, MAX_CONFIGMAP_BYTES, ConfigMapCheckpointStore
from stoker.control.policy_states import PolicyStates
from tests.kube.accounts import ADMIN_TOKEN
from tests.kube.conftest import NAMESPACE, Cluster_
from tests.platform.control.test_checkpoint import Clock, meter
from tests.platform.control.test_checkpoint_sources import learned, point, pool, sampler
from warm_pool.policies import make_policy
from warm_pool.policies.base import ScalingConfig

WALL = 1_764_568_800.0
BODY = {"figures": [1, 2.5, None], "name": "chat"}
CONFIGMAPS = f"/api/v1/namespaces/{NAMESPACE}/configmaps"


@pytest.fixture
async def stores(cluster: Cluster_) -> AsyncIterator[Callable[[], ConfigMapCheckpointStore]]:
    """Stores as controller replicas have them, each with its own client (closed after)."""
    made: list[ConfigMapCheckpointStore] = []

    def store(**kw) -> ConfigMapCheckpointStore:
        made.append(
            ConfigMapCheckpointStore(cluster.config_for("controller"), NAMESPACE, wall=lambda: WALL, **kw)
        )
        return made[-1]

    yield store
    for s in made:
        s.close()


def configmap(cluster: Cluster_, kind: str) -> dict | None:
    return cluster.api.get("configmaps", NAMESPACE, f"stoker-checkpoint-{kind}")


def writes(cluster: Cluster_) -> list[str]:
    """The verbs of the ConfigMap writes made so far, allowed or not."""
    return [
        c.attrs.verb
        for c in cluster.api.calls
        if c.attrs.resource == "configmaps" and c.attrs.verb in ("create", "update")
    ]


async def put(cluster: Cluster_, kind: str, body: dict) -> None:
    """As an administrator (kubectl apply): the ConfigMap of `kind` is `body` now."""
    obj = {"apiVersion": "v1", "kind": "ConfigMap", **body}
    obj["metadata"] = {"name": f"stoker-checkpoint-{kind}", **body.get("metadata", {})}
    async with httpx.AsyncClient(
        base_url=cluster.api.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as http:
        if configmap(cluster, kind) is None:
            answer = await http.post(CONFIGMAPS, json=obj)
        else:
            answer = await http.put(f"{CONFIGMAPS}/{obj['metadata']['name']}", json=obj)  # no version: forced
    assert answer.status_code in (200, 201), answer.text


def ours(kind: str, packed: bytes) -> dict:
    labels = {"app.kubernetes.io/managed-by": "stoker", "stoker.dev/checkpoint": kind}
    return {"metadata": {"labels": labels}, "binaryData": {KEY: base64.b64encode(packed).decode()}}


@pytest.mark.parametrize("kind", ["cost", "history", "policies"])
async def test_each_kind_round_trips_in_its_configmap_as_the_file_store_writes_it(
    cluster: Cluster_, stores, tmp_path: Path, kind: str
) -> None:
    store = stores()
    assert await asyncio.to_thread(store.read, kind) is None  # none yet: a first start
    await asyncio.to_thread(store.write, kind, BODY)
    assert await asyncio.to_thread(store.read, kind) == BODY
    await asyncio.to_thread(store.write, kind, {"figures": []})  # replaced whole
    assert await asyncio.to_thread(stores().read, kind) == {"figures": []}  # another replica reads it

    stored = configmap(cluster, kind)
    assert stored["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "stoker",
        "stoker.dev/checkpoint": kind,
    }
    assert set(stored["binaryData"]) == {KEY} and "data" not in stored
    files = FileCheckpointStore(tmp_path, wall=lambda: WALL)
    files.write(kind, {"figures": []})
    assert (
        gzip.decompress(base64.b64decode(stored["binaryData"][KEY]))
        == (tmp_path / f"{kind}.json").read_bytes()
    )
    assert store.where(kind) == f"ConfigMap {NAMESPACE}/stoker-checkpoint-{kind}"


async def test_the_sources_restored_from_the_configmaps_are_what_was_written(
    cluster: Cluster_, stores, tmp_path
) -> None:
    clock, wall = Clock(100.0), Clock(WALL)
    cost, history = meter(clock, wall), sampler(wall)
    cost.instance_seconds("chat", 1, "cpu", "READY", 10.0)
    cost.record("chat", 1, wall.now, 5, 7, 200)
    history.history.restore([point(WALL - 10), point(WALL - 5)])
    running = [("chat@1", pool(tmp_path, "predictive"))]
    state = learned("predictive")
    running[0][1].restore_policy("predictive", state)
    states = PolicyStates(lambda: running, clock, wall)
    await Checkpoints(stores(), [cost, history, states], 30.0).write()
    assert all(configmap(cluster, kind) is not None for kind in ("cost", "history", "policies"))

    # The next leader, on a clock whose origin moved: every source carries on.
    clock2 = Clock(7.0)
    again_cost, again_history, again_states = (
        meter(clock2, wall),
        sampler(wall),
        PolicyStates(lambda: [], clock2, wall),
    )
    await Checkpoints(stores(), [again_cost, again_history, again_states], 30.0).restore()
    assert again_cost.report() == cost.report()
    assert again_history.history.snapshot()["points"] == history.history.snapshot()["points"]
    chat = pool(tmp_path, "predictive")
    again_states.take("chat@1", chat)
    assert chat.saved_policy()[1].inner.histogram == state.inner.histogram
    assert chat.saved_policy()[1] != make_policy("predictive", ScalingConfig(max=2)).initial_state


async def test_a_checkpoint_over_a_configmaps_bound_is_refused_before_it_is_sent(
    cluster: Cluster_, stores
) -> None:
    store = stores()
    await asyncio.to_thread(store.write, "cost", BODY)
    before = writes(cluster)
    noise = {"noise": base64.b64encode(os.urandom(1_200_000)).decode()}  # gzips to ~1.2 MB
    with pytest.raises(CheckpointRefused) as err:
        await asyncio.to_thread(store.write, "cost", noise)
    assert re.fullmatch(
        rf"12\d{{5}} bytes gzipped \(16000\d\d bytes\), over a ConfigMap's bound of {MAX_CONFIGMAP_BYTES}: "
        r"not written \(the previous one stays\)",
        str(err.value),
    ), err.value
    assert writes(cluster) == before  # nothing sent
    assert await asyncio.to_thread(store.read, "cost") == BODY
    # The bound is the API server's own: a store that allowed more would be refused by it.
    lax = stores(max_bytes=2 * MAX_CONFIGMAP_BYTES)
    assert await asyncio.to_thread(lax.read, "cost") == BODY
    with pytest.raises(CheckpointRefused, match=r"Too long: must have at most 1048576 bytes"):
        await asyncio.to_thread(lax.write, "cost", noise)
    assert await asyncio.to_thread(store.read, "cost") == BODY
    # Nor is more than the file store's bound inflated at a read (a gzip bomb).
    await put(cluster, "cost", ours("cost", gzip.compress(b" " * (MAX_BYTES + 1))))
    with pytest.raises(CheckpointRefused, match=f"over the bound of {MAX_BYTES} bytes, inflated"):
        await asyncio.to_thread(store.read, "cost")


async def test_a_configmap_that_is_not_stokers_is_refused_left_alone_and_the_source_starts_clean(
    cluster: Cluster_, stores, caplog
) -> None:
    await put(cluster, "cost", {"data": {"cost": "someone else's"}})
    cost = meter(Clock(), Clock(WALL))
    caplog.set_level(logging.INFO, logger="stoker.checkpoint")
    checkpoints = Checkpoints(stores(), [cost], 30.0)
    await checkpoints.restore()
    assert cost.report() == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"checkpoint ConfigMap {NAMESPACE}/stoker-checkpoint-cost refused: not Stoker's checkpoint of cost "
        "(want the labels app.kubernetes.io/managed-by=stoker, stoker.dev/checkpoint=cost): left alone; "
        "cost starts clean"
    ]
    cost.instance_seconds("chat", 1, "cpu", "READY", 10.0)
    await checkpoints.write()  # refused, logged: theirs is never overwritten
    assert configmap(cluster, "cost")["data"] == {"cost": "someone else's"}
    assert "that is not Stoker's is there: not overwritten" in caplog.records[-1].getMessage()


@pytest.mark.parametrize(
    ("packed", "why"),
    [
        (b"\x1f\x8b not gzip", "not gzip (truncated or corrupt)"),
        (gzip.compress(b'{"format": 1, "kind": "cost"')[:-6], "not gzip (truncated"),
        (gzip.compress(b"{not json"), "not JSON (truncated or corrupt)"),
        (
            gzip.compress(b'{"format":2,"kind":"cost","written_at":1.0,"body":{}}'),
            "format 2, and this version reads format 1",
        ),
        (
            gzip.compress(b'{"format":1,"kind":"history","written_at":1.0,"body":{}}'),
            "a checkpoint of 'history'",
        ),
    ],
    ids=["not-gzip", "truncated", "not-json", "another-format", "another-kind"],
)
async def test_stokers_own_configmap_that_cannot_be_trusted_is_refused_then_replaced(
    cluster: Cluster_, stores, packed: bytes, why: str
) -> None:
    await put(cluster, "cost", ours("cost", packed))
    store = stores()
    with pytest.raises(CheckpointRefused) as err:
        await asyncio.to_thread(store.read, "cost")
    assert why in str(err.value)
    await asyncio.to_thread(store.write, "cost", BODY)  # as a corrupt file is: replaced at the next write
    assert await asyncio.to_thread(stores().read, "cost") == BODY


async def test_a_configmap_without_the_checkpoint_is_refused(cluster: Cluster_, stores) -> None:
    await put(cluster, "cost", {**ours("cost", gzip.compress(b"{}")), "binaryData": {"other.gz": "AA=="}})
    with pytest.raises(CheckpointRefused, match=f"want binaryData {KEY} alone"):
        await asyncio.to_thread(stores().read, "cost")


async def test_a_write_over_another_writers_is_refused_and_theirs_stays(cluster: Cluster_, stores) -> None:
    old, new = stores(), stores()  # the replica that led, and the one that leads now
    assert await asyncio.to_thread(old.read, "cost") is None
    await asyncio.to_thread(old.write, "cost", {"by": "old"})
    assert await asyncio.to_thread(new.read, "cost") == {"by": "old"}
    await asyncio.to_thread(new.write, "cost", {"by": "new"})
    with pytest.raises(CheckpointRefused, match="changed by another writer since this replica read"):
        await asyncio.to_thread(old.write, "cost", {"by": "old, at its shutdown"})
    assert await asyncio.to_thread(stores().read, "cost") == {"by": "new"}
    await asyncio.to_thread(new.write, "cost", {"by": "new, again"})  # the leader's own go on
    assert await asyncio.to_thread(stores().read, "cost") == {"by": "new, again"}

    # Two that both saw none: the second create is refused, not turned into a replace.
    a, b = stores(), stores()
    assert await asyncio.to_thread(a.read, "history") is None
    assert await asyncio.to_thread(b.read, "history") is None
    await asyncio.to_thread(a.write, "history", {"by": "a"})
    with pytest.raises(CheckpointRefused, match="changed by another writer since this replica saw none"):
        await asyncio.to_thread(b.write, "history", {"by": "b"})
    assert await asyncio.to_thread(stores().read, "history") == {"by": "a"}


async def test_a_kind_never_read_is_read_before_it_is_written(cluster: Cluster_, stores) -> None:
    await asyncio.to_thread(stores().write, "cost", {"by": "first"})
    await asyncio.to_thread(stores().write, "cost", {"by": "second"})  # its read failed, say: read now
    assert await asyncio.to_thread(stores().read, "cost") == {"by": "second"}
    with pytest.raises(ValueError, match="plain lowercase name"):
        stores().name("Cost_1")
