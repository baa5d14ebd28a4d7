"""The chart's RBAC against what the processes do, on the fake API server that enforces it: the
rules the chart once had refuse what the backend does with Secrets, today's allow it, every call
a process's code declares is one it makes, and an account may do nothing it was not granted."""

from __future__ import annotations

import asyncio
import copy
import secrets
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from lightkube import AsyncClient

from snapshots import SnapshotStore
from snapshots.remote import RemoteConfig
from stoker.control.kube.checkpoints import ConfigMapCheckpointStore
from stoker.control.kube.keys import SecretKeyStore
from stoker.control.kube.registry import ResourceRegistry
from stoker.control.kube.routes import ResourceRoutes
from stoker.control.leader import LeaderElector
from stoker.node.agent import AgentConfig, NodeAgent
from stoker.spec.deployment import DeploymentSpec
from stoker.spec.routes import CascadeRoute
from tests.kube.accounts import DECLARED, TOKENS, asked, chart_access
from tests.kube.conftest import NAMESPACE, Cluster_, TinyStore, running_cluster
from tests.kube.fake.rbac import Policy
from tests.kube.test_backend import READY_S, Source, placement, web_spec
from warm_pool.backends.kube import snapshot_label
from warm_pool.errors import PoolError

CONTROLLER = f"system:serviceaccount:{NAMESPACE}:stoker-controller"


def old_rules() -> Policy:
    """The chart as it was: Secrets get, create and delete only."""
    objects = copy.deepcopy(list(chart_access().objects))
    role = next(o for o in objects if o["kind"] == "Role")
    for rule in role["rules"]:
        if rule["resources"] == ["secrets"]:
            rule["verbs"] = ["get", "create", "delete"]
    return Policy.from_objects(objects)


async def leave_secret(cluster: Cluster_, instance_id: str) -> None:
    """A Secret an earlier, failed start of the instance left behind."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{instance_id}-key"}, "data": {}}
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=admin(cluster)) as http:
        assert (await http.post(f"/api/v1/namespaces/{NAMESPACE}/secrets", json=secret)).status_code == 201


def admin(cluster: Cluster_) -> dict[str, str]:
    return {"Authorization": f"Bearer {cluster.config.get().user.token}"}


def refused(cluster: Cluster_, verb: str, resource: str) -> bool:
    return any(
        c.user == CONTROLLER and not c.allowed and (c.attrs.verb, c.attrs.full_resource) == (verb, resource)
        for c in cluster.api.calls
    )


async def test_the_old_rules_refuse_the_secret_replace_and_patch_the_backend_does(
    pod_logs: Path, stoker_env: dict[str, str], tiny_store: TinyStore
) -> None:
    async with running_cluster(pod_logs, stoker_env, policy=old_rules()) as cluster:
        cluster.probing = True
        backend = cluster.backend(tiny_store.root)
        try:
            await leave_secret(cluster, "tiny-0b0b0b0b")
            with pytest.raises(PoolError) as failed:
                await backend.start(placement(tiny_store, "tiny-0b0b0b0b"), web_spec())
            assert (
                'secrets "tiny-0b0b0b0b-key" is forbidden: User "system:serviceaccount:stoker:stoker-controller" '
                'cannot update resource "secrets" in API group "" in the namespace "stoker"'
            ) in str(failed.value)
            assert refused(cluster, "update", "secrets")

            handle = await backend.start(placement(tiny_store, "tiny-0c0c0c0c"), web_spec())
            assert refused(cluster, "patch", "secrets")  # the pod never became the Secret's owner
            secret = cluster.api.get("secrets", NAMESPACE, "tiny-0c0c0c0c-key")
            assert "ownerReferences" not in secret["metadata"]
            await backend.stop(handle, term_timeout_s=5)
        finally:
            await backend.aclose()


async def test_the_chart_allows_the_secret_replace_and_patch(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    backend = cluster.backend(tiny_store.root)
    try:
        await leave_secret(cluster, "tiny-0d0d0d0d")
        handle = await backend.start(placement(tiny_store, "tiny-0d0d0d0d", "sk-new-key-0123"), web_spec())
        secret = cluster.api.get("secrets", NAMESPACE, "tiny-0d0d0d0d-key")
        pod = cluster.api.get("pods", NAMESPACE, "tiny-0d0d0d0d")
        assert secret["data"]["key"]  # replaced: the left one had no key
        assert [ref["uid"] for ref in secret["metadata"]["ownerReferences"]] == [pod["metadata"]["uid"]]
        await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()
    assert not [c for c in cluster.api.calls if not c.allowed]


async def test_every_call_the_code_declares_is_one_it_makes(
    cluster: Cluster_, tiny_store: TinyStore, tmp_path: Path
) -> None:
    """Each component's processes, driven through everything they do: the calls made are exactly
    the declared ones, so no declaration (and so no grant of the chart) is left over."""
    key = secrets.token_urlsafe(16)
    backend, restarted = cluster.backend(tiny_store.root), cluster.backend(tiny_store.root)
    controller = AsyncClient(config=cluster.config_for("controller"), namespace=NAMESPACE)
    node = AsyncClient(config=cluster.config_for("node"))
    try:
        await backend.check_admission()
        await backend.acquire(Source(tiny_store.snapshot_id), "tiny-0e0e0e0e")
        await leave_secret(cluster, "tiny-0e0e0e0e")
        handle = await backend.start(placement(tiny_store, "tiny-0e0e0e0e", key), web_spec())
        await backend.wait_ready(handle, READY_S, health_path="/")
        assert await backend.read_log("tiny-0e0e0e0e", 1000) is not None
        await backend.aclose()
        [adopted] = await restarted.running()
        assert adopted.secret == key
        await restarted.stop(adopted.handle, term_timeout_s=5)

        elector = LeaderElector(controller, NAMESPACE, "stoker-controller", "a", lease_s=6, renew_s=1)
        assert await elector._try_acquire_or_renew()  # none yet: created
        assert await elector._try_acquire_or_renew()  # ours: replaced
        await elector._release()

        checkpoints = ConfigMapCheckpointStore(cluster.config_for("controller"), NAMESPACE)
        try:  # its calls block: in a thread, as `Checkpoints` makes them
            assert await asyncio.to_thread(checkpoints.read, "cost") is None
            await asyncio.to_thread(checkpoints.write, "cost", {})  # none yet: created
            await asyncio.to_thread(checkpoints.write, "cost", {})  # ours: replaced
        finally:
            checkpoints.close()

        # The deployments as resources: listed and watched, created, replaced, their status
        # patched, then deleted with their revisions (read again, the finalizer patched off).
        registry = ResourceRegistry(controller, NAMESPACE)
        registry.start()
        await registry.wait_synced(READY_S)
        spec = DeploymentSpec(name="tiny", model="tiny", snapshot_id=tiny_store.snapshot_id)
        await registry.put(spec)
        await registry.put(replace(spec, max=2))
        await registry.write_status("tiny", {"ready": 0})
        await registry.delete("tiny")
        await registry.aclose()

        # Tenant keys as Secrets (listed and watched, created, revoked) and cascade routes as
        # StokerRoutes (listed and watched, created, replaced, deleted).
        keys = SecretKeyStore(controller, NAMESPACE)
        keys.start()
        await keys.wait_synced(READY_S)
        record, _ = await keys.create("acme", ("tiny",))
        await keys.revoke(record.id)
        await keys.aclose()
        routes = ResourceRoutes(controller, NAMESPACE)
        routes.start()
        await routes.wait_synced(READY_S)
        assert await routes.put(CascadeRoute("assist", "tiny", "tiny-large"))
        assert not await routes.put(CascadeRoute("assist", "tiny", "tiny-large", -2.0))
        await routes.delete("assist")
        await routes.aclose()

        store = SnapshotStore(tmp_path / "store")  # holds nothing
        config = AgentConfig("http://127.0.0.1:9", "node-a", warm=False)
        agent = NodeAgent(config, store, node, RemoteConfig.from_env(), "admin-key")
        stale = snapshot_label("f" * 64)  # a label for a snapshot this store does not hold
        cluster.api.get("nodes", "", "node-a")["metadata"]["labels"][stale] = "true"
        errors: list[str] = []
        await agent._report(errors)  # the stale label goes: a read, then a patch
        assert errors == []
    finally:
        for b in (backend, restarted):
            await b.aclose()
        await controller.close()
        await node.close()
    access = chart_access()
    for component, user in access.accounts.items():
        made = {asked(c) for c in cluster.api.calls if c.user == user.name}
        assert made == DECLARED[component], component


@pytest.mark.parametrize(
    ("component", "path", "message"),
    [
        (
            "gateway",
            f"/api/v1/namespaces/{NAMESPACE}/pods",
            'pods is forbidden: User "system:serviceaccount:stoker:stoker-gateway" cannot list resource "pods" '
            'in API group "" in the namespace "stoker"',
        ),
        (
            "node",
            f"/api/v1/namespaces/{NAMESPACE}/secrets/x",
            'secrets "x" is forbidden: User "system:serviceaccount:stoker:stoker-node" cannot get resource '
            '"secrets" in API group "" in the namespace "stoker"',
        ),
        (
            "controller",
            "/api/v1/nodes/node-a",
            'nodes "node-a" is forbidden: User "system:serviceaccount:stoker:stoker-controller" cannot get '
            'resource "nodes" in API group "" at the cluster scope',
        ),
        (
            "controller",
            f"/api/v1/namespaces/{NAMESPACE}/pods/p/status",
            'pods "p" is forbidden: User "system:serviceaccount:stoker:stoker-controller" cannot get resource '
            '"pods/status" in API group "" in the namespace "stoker"',
        ),
        (
            "controller",
            "/apis/coordination.k8s.io/v1/namespaces/other/leases/stoker-controller",
            'leases.coordination.k8s.io "stoker-controller" is forbidden: User '
            '"system:serviceaccount:stoker:stoker-controller" cannot get resource "leases" in API group '
            '"coordination.k8s.io" in the namespace "other"',
        ),
    ],
)
async def test_an_account_may_do_nothing_it_was_not_granted(
    cluster: Cluster_, component: str, path: str, message: str
) -> None:
    cluster.probing = True
    async with httpx.AsyncClient(
        base_url=cluster.api.url, headers={"Authorization": f"Bearer {TOKENS[component]}"}
    ) as http:
        answer = await http.get(path)
    assert answer.status_code == 403
    assert answer.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Forbidden",
        "code": 403,
    }
