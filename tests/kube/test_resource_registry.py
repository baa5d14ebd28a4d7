"""The registry on a cluster (`stoker.control.kube.registry`) against the fake API server, as the
controller's service account: what `stoker deploy` writes, what a race with `kubectl apply` gets
(409, nothing overwritten), and what a delete leaves (nothing). In this process: the fake shares
the test's event loop, and the registry's client is async."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from lightkube import AsyncClient

from stoker.control.kube.registry import ResourceRegistry, declares
from stoker.errors import APIError
from stoker.spec.deployment import DeploymentSpec
from tests.kube.accounts import ADMIN_TOKEN
from tests.kube.conftest import NAMESPACE, Cluster_

DEPLOYMENTS = f"/apis/stoker.dev/v1alpha1/namespaces/{NAMESPACE}/stokerdeployments"
SPEC = DeploymentSpec(name="chat", model="tiny", snapshot_id="a" * 64)
SYNC_S = 30.0


@pytest.fixture
async def registry(cluster: Cluster_):
    client = AsyncClient(config=cluster.config_for("controller"), namespace=NAMESPACE)
    registry = ResourceRegistry(client, NAMESPACE)
    registry.start()
    await registry.wait_synced(SYNC_S)
    yield registry
    await registry.aclose()
    await client.close()


@pytest.fixture
async def kubectl(cluster: Cluster_):
    async with httpx.AsyncClient(
        base_url=cluster.api.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as http:
        yield http


async def test_a_deploy_writes_the_resource_and_its_revision(
    cluster: Cluster_, registry: ResourceRegistry
) -> None:
    first = await registry.put(SPEC)
    second = await registry.create_revision(replace(SPEC, max=3))
    assert (first.revision, second.revision) == (1, 2)
    obj = cluster.api.get("stokerdeployments.stoker.dev", NAMESPACE, "chat")
    assert obj["spec"]["model"] == "tiny" and obj["spec"]["max"] == 3
    assert obj["metadata"]["finalizers"] == ["stoker.dev/drain"]
    assert declares(obj, second) and not declares(obj, first)
    rev = cluster.api.get("stokerrevisions.stoker.dev", NAMESPACE, "chat-r2")
    assert rev["spec"]["snapshotId"] == "a" * 64 and rev["spec"]["revision"] == 2
    assert rev["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert [s.revision for s, _ in registry.revisions("chat")] == [1, 2]
    assert registry.revision("chat", 2) == second
    assert registry.all() == [second] and registry.traffic("chat") == {1: 100}
    # A new registry (a new leader) reads the same, the split from the status the leader wrote.
    await registry.write_status("chat", {"traffic": {"1": 40, "2": 60}})
    client = AsyncClient(config=cluster.config_for("controller"), namespace=NAMESPACE)
    again = ResourceRegistry(client, NAMESPACE)
    again.start()
    try:
        await again.wait_synced(SYNC_S)
        assert again.revisions("chat") == registry.revisions("chat")
        assert again.traffic("chat") == {1: 40, 2: 60}
        assert [s.revision for s in again.serving()] == [1, 2]
    finally:
        await again.aclose()
        await client.close()


async def test_a_deploy_racing_an_apply_is_refused_not_written(
    cluster: Cluster_, registry: ResourceRegistry, kubectl: httpx.AsyncClient
) -> None:
    await registry.put(SPEC)
    await registry.deployments.close()  # the mirror stops here: the apply below is not seen
    r = await kubectl.patch(
        f"{DEPLOYMENTS}/chat",
        json={"spec": {"max": 5}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert r.status_code == 200, r.text
    with pytest.raises(APIError) as refused:
        await registry.put(replace(SPEC, max=2))
    assert refused.value.status == 409 and refused.value.code == "conflict"
    assert cluster.api.get("stokerdeployments.stoker.dev", NAMESPACE, "chat")["spec"]["max"] == 5  # theirs
    assert [s.revision for s, _ in registry.revisions("chat")] == [1]  # no revision for the refused one


async def test_a_name_kubernetes_cannot_hold_is_a_400_naming_it(registry: ResourceRegistry) -> None:
    with pytest.raises(APIError) as refused:
        await registry.put(replace(SPEC, name="my_chat"))
    assert refused.value.status == 400 and refused.value.param == "name"
    assert "no '_'" in refused.value.message


async def test_a_delete_leaves_nothing_and_the_numbering_restarts(
    cluster: Cluster_, registry: ResourceRegistry
) -> None:
    await registry.put(SPEC)
    await registry.put(SPEC)
    await registry.delete("chat")
    assert cluster.api.get("stokerdeployments.stoker.dev", NAMESPACE, "chat") is None
    assert not [k for k in cluster.api.store.objects if k[0] == "stokerrevisions.stoker.dev"]
    assert registry.revisions("chat") == [] and registry.traffic("chat") == {}
    assert (await registry.put(SPEC)).revision == 1
