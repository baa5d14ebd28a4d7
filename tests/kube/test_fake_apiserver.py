"""The fake API server answers as the real one does where our clients depend on it."""

from __future__ import annotations

import httpx

from tests.kube.conftest import NAMESPACE, TOKEN, Cluster_

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def pod(**container: object) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "i", **container}]},
    }


async def test_requests_without_the_token_are_401_as_a_status(cluster: Cluster_) -> None:
    async with httpx.AsyncClient(base_url=cluster.api.url) as http:
        answer = await http.get(f"/api/v1/namespaces/{NAMESPACE}/pods")
    assert answer.status_code == 401
    assert answer.json()["kind"] == "Status" and answer.json()["reason"] == "Unauthorized"


async def test_an_object_against_the_schema_is_422_invalid_and_not_stored(cluster: Cluster_) -> None:
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        typo = await http.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod(comand=["x"]))
        wrong_type = await http.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod(args="x"))
        fine = await http.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod(args=["x"]))
    for answer in (typo, wrong_type):
        assert answer.status_code == 422 and answer.json()["reason"] == "Invalid", answer.text
    assert "comand" in typo.json()["message"]
    assert fine.status_code == 201


async def test_a_replace_with_a_stale_version_is_409_and_a_second_create_too(cluster: Cluster_) -> None:
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "l"},
        "spec": {"holderIdentity": "a"},
    }
    base = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        created = (await http.post(base, json=lease)).json()
        assert (await http.post(base, json=lease)).json()["reason"] == "AlreadyExists"
        created["spec"]["holderIdentity"] = "b"
        assert (await http.put(f"{base}/l", json=created)).status_code == 200
        stale = await http.put(f"{base}/l", json=created)  # the same version again
    assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"


async def test_a_watch_from_a_compacted_version_is_410_expired(cluster: Cluster_) -> None:
    cluster.api.compact()
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        answer = await http.get(
            f"/api/v1/namespaces/{NAMESPACE}/pods", params={"watch": "true", "resourceVersion": "1"}
        )
    event = answer.json()
    assert (
        event["type"] == "ERROR" and event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"
    )
