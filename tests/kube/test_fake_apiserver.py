"""The fake API server answers as the real one does where our clients depend on it."""

from __future__ import annotations

import base64

import httpx

from tests.kube.accounts import ADMIN_TOKEN
from tests.kube.conftest import NAMESPACE, Cluster_

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


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


async def test_a_namespaced_object_needs_its_namespace(cluster: Cluster_) -> None:
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        answer = await http.post("/api/v1/namespaces/nowhere/pods", json=pod())
    assert answer.status_code == 404 and answer.json()["message"] == 'namespaces "nowhere" not found'


async def test_a_dry_run_is_checked_whole_and_stores_nothing(cluster: Cluster_) -> None:
    base = f"/api/v1/namespaces/{NAMESPACE}/pods"
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        fine = await http.post(base, json=pod(), params={"dryRun": "All"})
        typo = await http.post(base, json=pod(comand=["x"]), params={"dryRun": "All"})
    assert fine.status_code == 201 and fine.json()["metadata"]["uid"]
    assert typo.status_code == 422
    assert cluster.api.get("pods", NAMESPACE, "p") is None
    assert not [e for e in cluster.api.store.history if e[1] == "pods"]  # no event either


async def test_an_object_goes_once_all_its_owners_are_gone(cluster: Cluster_) -> None:
    a, b = (cluster.api.get("nodes", "", n)["metadata"] for n in ("node-a", "node-b"))
    owners = [{"apiVersion": "v1", "kind": "Node", "name": m["name"], "uid": m["uid"]} for m in (a, b)]
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "ownerReferences": owners}}
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        assert (await http.post(f"/api/v1/namespaces/{NAMESPACE}/secrets", json=secret)).status_code == 201
        assert (await http.delete("/api/v1/nodes/node-a")).status_code == 200
        assert cluster.api.get("secrets", NAMESPACE, "s") is not None  # node-b still owns it
        assert (await http.delete("/api/v1/nodes/node-b")).status_code == 200
    assert cluster.api.get("secrets", NAMESPACE, "s") is None


async def test_a_collection_is_deleted_by_label(cluster: Cluster_) -> None:
    base = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        for name, team in (("a", "x"), ("b", "x"), ("c", "y")):
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "labels": {"team": team}},
            }
            assert (await http.post(base, json=secret)).status_code == 201
        assert (await http.delete(base, params={"labelSelector": "team=x"})).status_code == 200
        left = (await http.get(base)).json()["items"]
    assert [s["metadata"]["name"] for s in left] == ["c"]


async def test_an_unknown_kind_or_subresource_is_404(cluster: Cluster_) -> None:
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        for path in (
            f"/api/v1/namespaces/{NAMESPACE}/services",
            f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
            f"/api/v1/namespaces/{NAMESPACE}/secrets/s/status",
            "/api/v1/namespaces/stoker/leases",  # a Lease is coordination.k8s.io's
        ):
            answer = await http.get(path)
            assert answer.status_code == 404 and answer.json()["reason"] == "NotFound", path


def configmap(name: str, data: dict | None = None, binary: dict[str, bytes] | None = None) -> dict:
    obj: dict = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}
    if data is not None:
        obj["data"] = data
    if binary is not None:
        obj["binaryData"] = {k: base64.b64encode(v).decode() for k, v in binary.items()}
    return obj


async def test_a_configmap_over_1_mib_is_422_in_the_api_servers_words_and_not_stored(
    cluster: Cluster_,
) -> None:
    base = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
    # data and binaryData count together, binaryData decoded: exactly 1 MiB is the most there is.
    most = configmap("most", {"a": "x" * 1000}, {"b": b"\0" * ((1 << 20) - 1000)})
    over = configmap("over", {"a": "x" * 1001}, {"b": b"\0" * ((1 << 20) - 1000)})
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        fine = await http.post(base, json=most)
        big = await http.post(base, json=over)
        grown = {**fine.json(), "data": {"a": "x" * 1001}}
        replaced = await http.put(f"{base}/most", json=grown)
    assert fine.status_code == 201, fine.text
    for answer, name in ((big, "over"), (replaced, "most")):
        assert answer.status_code == 422 and answer.json()["reason"] == "Invalid"
        assert answer.json()["message"] == (
            f'ConfigMap "{name}" is invalid: []: Too long: must have at most 1048576 bytes'
        )
    assert cluster.api.get("configmaps", NAMESPACE, "over") is None
    assert cluster.api.get("configmaps", NAMESPACE, "most")["data"] == {"a": "x" * 1000}


async def test_a_configmaps_keys_and_binary_data_are_checked(cluster: Cluster_) -> None:
    base = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
    not_base64 = {**configmap("b"), "binaryData": {"k": "not base64!"}}
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=AUTH) as http:
        answers = {
            "slash": await http.post(base, json=configmap("s", {"a/b": "x"})),
            "dots": await http.post(base, json=configmap("d", {"..": "x"})),
            "long": await http.post(base, json=configmap("l", {"k" * 254: "x"})),
            "base64": await http.post(base, json=not_base64),
            "both": await http.post(base, json=configmap("t", {"k": "x"}, {"k": b"x"})),
            "fine": await http.post(base, json=configmap("f", {"k.json_-1": "x"}, {"k.gz": b"\x1f"})),
        }
    messages = {why: a.json()["message"] for why, a in answers.items() if a.status_code == 422}
    assert set(messages) == {"slash", "dots", "long", "base64", "both"}, answers["fine"].text
    assert "data[a/b]: Invalid value" in messages["slash"] and "a valid config key" in messages["slash"]
    assert "must not be '..'" in messages["dots"]
    assert "must be no more than 253 characters" in messages["long"]
    assert "binaryData[k]: not base64" in messages["base64"]
    assert "duplicate of key present in data" in messages["both"]
    assert cluster.api.get("configmaps", NAMESPACE, "f")["binaryData"] == {"k.gz": "Hw=="}
