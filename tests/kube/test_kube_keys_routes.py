"""Tenant keys as Secrets and cascade routes as StokerRoutes (`stoker.control.kube.keys`,
`stoker.control.kube.routes`), against the fake API server over real HTTP, as the controller's
service account; what someone else applies is applied as admin, as `kubectl apply` would. The fake
shares this event loop, so the stores run in-process on async clients."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import httpx
import pytest
from lightkube import AsyncClient

from stoker.control.kube.keys import SecretKeyStore
from stoker.control.kube.routes import ResourceRoutes
from stoker.errors import APIError
from stoker.spec.keys import Limits, hash_key
from stoker.spec.routes import CascadeRoute
from tests.kube.conftest import NAMESPACE, Cluster_
from tests.kube.test_rbac import admin

SECRETS = f"/api/v1/namespaces/{NAMESPACE}/secrets"
ROUTES = f"/apis/stoker.dev/v1alpha1/namespaces/{NAMESPACE}/stokerroutes"
SYNC_S = 10.0


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def key_secret(name: str, key: str, **data: str) -> dict:
    """A key declared as its hash, as a team would keep it in Git."""
    fields = {"hash": hash_key(key), "tenant": "ci", "deployments": '["chat"]', **data}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "stoker.dev/api-key",
        "metadata": {"name": name, "labels": {"stoker.dev/key": "true"}},
        "data": {k: b64(v) for k, v in fields.items()},
    }


async def until(condition, what: str, within_s: float = SYNC_S) -> None:
    end = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {within_s:g} s")
        await asyncio.sleep(0.02)


@pytest.fixture
async def controller(cluster: Cluster_):
    client = AsyncClient(config=cluster.config_for("controller"), namespace=NAMESPACE)
    yield client
    await client.close()


@pytest.fixture
async def kubectl(cluster: Cluster_):
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=admin(cluster)) as http:
        yield http


async def synced_keys(client: AsyncClient, changes: list[int] | None = None) -> SecretKeyStore:
    store = SecretKeyStore(
        client, NAMESPACE, on_change=(lambda: changes.append(1)) if changes is not None else None
    )
    store.start()
    await store.wait_synced(SYNC_S)
    return store


async def test_a_key_is_a_secret_holding_its_hash_never_the_key(
    cluster: Cluster_, controller, kubectl
) -> None:
    changes: list[int] = []
    store = await synced_keys(controller, changes)
    try:
        assert len(store) == 0
        limits = Limits(rps=5.0, tpm=20000)
        record, key = await store.create("acme", ("chat", "summarise"), limits)
        assert store.lookup(key) == record and len(store) == 1 and changes
        assert store.lookup(key + "x") is None
        name = "stoker-key-" + record.id.removeprefix("key_")
        secret = cluster.api.get("secrets", NAMESPACE, name)
        assert secret["type"] == "stoker.dev/api-key"
        assert secret["metadata"]["labels"] == {
            "stoker.dev/key": "true",
            "app.kubernetes.io/managed-by": "stoker",
        }
        assert base64.b64decode(secret["data"]["hash"]).decode() == hash_key(key)
        assert json.loads(base64.b64decode(secret["data"]["deployments"])) == ["chat", "summarise"]
        # The key itself is nowhere in what the API server holds, plainly or as base64.
        stored = json.dumps(list(cluster.api.store.objects.values()))
        assert key not in stored and b64(key) not in stored
        assert store.hashed() == [{**record.to_dict(), "hash": hash_key(key)}]

        again = await synced_keys(controller)  # a restarted controller
        try:
            assert again.lookup(key) == record and again.all() == [record]
        finally:
            await again.aclose()

        assert await store.revoke(record.id) == record
        assert store.lookup(key) is None and len(store) == 0
        assert cluster.api.get("secrets", NAMESPACE, name) is None
        with pytest.raises(APIError) as gone:
            await store.revoke(record.id)
        assert (gone.value.status, gone.value.code) == (404, "key_not_found")
    finally:
        await store.aclose()


async def test_a_key_declared_as_its_hash_is_a_key_and_a_malformed_one_is_ignored(
    cluster: Cluster_, controller, kubectl, caplog
) -> None:
    store = await synced_keys(controller)
    try:
        key = "sk-stoker-declared-in-git-0123456789"
        applied = key_secret("stoker-key-ci", key, limits='{"max_concurrent": 2}')
        assert (await kubectl.post(SECRETS, json=applied)).status_code == 201
        await until(lambda: store.lookup(key) is not None, "the applied key seen")
        record = store.lookup(key)
        assert (record.id, record.tenant, record.deployments) == ("key_ci", "ci", ("chat",))
        assert record.limits == Limits(max_concurrent=2) and record.created > 0

        with caplog.at_level(logging.WARNING, logger="stoker.kube"):
            bad = key_secret("stoker-key-bad", "sk-stoker-other", deployments="chat")  # not JSON
            assert (await kubectl.post(SECRETS, json=bad)).status_code == 201
            worse = key_secret("stoker-key-worse", "sk-stoker-third")
            worse["data"]["hash"] = b64("not-a-hash")
            assert (await kubectl.post(SECRETS, json=worse)).status_code == 201
            await until(lambda: "stoker-key-worse" in caplog.text, "the malformed ones logged")
            cluster.api.drop_watches()  # listed again: what is unchanged is not logged again
            later = "sk-stoker-after-the-relist"
            assert (
                await kubectl.post(SECRETS, json=key_secret("stoker-key-later", later))
            ).status_code == 201
            await until(lambda: store.lookup(later) is not None, "the next key seen")
        assert caplog.text.count("stoker-key-bad") == 1
        assert "stoker-key-bad" in caplog.text and "no key, ignored" in caplog.text
        assert store.lookup("sk-stoker-other") is None and [r.id for r in store.all()] == [
            "key_ci",
            "key_later",
        ]

        # A second Secret with that hash: the older keeps it; a revoke deletes both, so the key
        # is not valid again through the other.
        with caplog.at_level(logging.WARNING, logger="stoker.kube"):
            twin = key_secret("stoker-key-twin", key, created=repr(record.created + 60))
            assert (await kubectl.post(SECRETS, json=twin)).status_code == 201
            await until(lambda: "stoker-key-twin" in caplog.text, "the twin logged")
        assert "the older, keeps it" in caplog.text and store.lookup(key).id == "key_ci"
        await store.revoke("key_ci")
        assert store.lookup(key) is None
        assert [cluster.api.get("secrets", NAMESPACE, n) for n in ("stoker-key-ci", "stoker-key-twin")] == [
            None,
            None,
        ]
    finally:
        await store.aclose()


async def test_a_name_clash_is_a_409(cluster: Cluster_, controller, kubectl, monkeypatch) -> None:
    store = await synced_keys(controller)
    try:
        monkeypatch.setattr("stoker.control.kube.keys.secrets.token_hex", lambda n: "0" * (2 * n))
        taken = key_secret("stoker-key-" + "0" * 16, "sk-stoker-x")
        assert (await kubectl.post(SECRETS, json=taken)).status_code == 201
        with pytest.raises(APIError) as clash:
            await store.create("acme", ("chat",))
        assert (clash.value.status, clash.value.code) == (409, "conflict")
    finally:
        await store.aclose()


async def synced_routes(client: AsyncClient) -> ResourceRoutes:
    routes = ResourceRoutes(client, NAMESPACE)
    routes.start()
    await routes.wait_synced(SYNC_S)
    return routes


async def test_routes_are_stoker_routes(cluster: Cluster_, controller, kubectl, caplog) -> None:
    routes = await synced_routes(controller)
    try:
        assert await routes.put(CascadeRoute("assist", "small", "large")) is True
        assert await routes.put(CascadeRoute("assist", "small", "large", -2.0)) is False
        obj = cluster.api.get("stokerroutes.stoker.dev", NAMESPACE, "assist")
        assert obj["spec"] == {
            "small": "small",
            "large": "large",
            "minMeanLogprob": -2.0,
            "escalateOnContext": True,
        }
        assert routes.get("assist") == CascadeRoute("assist", "small", "large", -2.0)

        applied = {
            "apiVersion": "stoker.dev/v1alpha1",
            "kind": "StokerRoute",
            "metadata": {"name": "from-git"},
            "spec": {"small": "s", "large": "l", "minMeanLogprob": -0.5},
        }
        assert (await kubectl.post(ROUTES, json=applied)).status_code == 201
        await until(lambda: routes.get("from-git") is not None, "the applied route seen")
        assert [r.name for r in routes.all()] == ["assist", "from-git"]
        assert routes.get("from-git") == CascadeRoute("from-git", "s", "l", -0.5, True)

        with caplog.at_level(logging.WARNING, logger="stoker.kube"):
            same = {**applied, "metadata": {"name": "loop"}, "spec": {"small": "x", "large": "x"}}
            assert (await kubectl.post(ROUTES, json=same)).status_code == 201
            await until(lambda: "StokerRoute stoker/loop" in caplog.text, "the invalid route logged")
        assert routes.get("loop") is None and [r.name for r in routes.all()] == ["assist", "from-git"]

        again = await synced_routes(controller)  # a restarted controller
        assert [r.name for r in again.all()] == ["assist", "from-git"]
        await again.aclose()

        # A replica whose copy is stale (its watch stopped here) is refused, not last-writer-wins.
        await routes.aclose()
        current = (await kubectl.get(f"{ROUTES}/assist")).json()
        current["spec"]["minMeanLogprob"] = -3.0
        assert (await kubectl.put(f"{ROUTES}/assist", json=current)).status_code == 200
        with pytest.raises(APIError) as stale:
            await routes.put(CascadeRoute("assist", "small", "large", -1.0))
        assert (stale.value.status, stale.value.code) == (409, "conflict")
        assert (
            cluster.api.get("stokerroutes.stoker.dev", NAMESPACE, "assist")["spec"]["minMeanLogprob"] == -3.0
        )

        routes = await synced_routes(controller)
        assert (await routes.delete("assist")).name == "assist"
        assert cluster.api.get("stokerroutes.stoker.dev", NAMESPACE, "assist") is None
        assert routes.get("assist") is None
        with pytest.raises(APIError) as gone:
            await routes.delete("assist")
        assert (gone.value.status, gone.value.code) == (404, "route_not_found")

        with pytest.raises(APIError) as bad:
            await routes.put(CascadeRoute("my_route", "small", "large"))
        assert (bad.value.status, bad.value.param) == (400, "name") and "no '_'" in bad.value.message
    finally:
        await routes.aclose()
