"""The fake API server's patches, as the API server applies them: tables of strategic merge patches
on the kinds our code and the fake kubelet patch (a Secret's ownerReferences, a Node's labels, a
pod's status conditions, a Lease's spec) and on the lists Kubernetes merges by key; JSON merge
patch replacing lists whole; and the same over HTTP, chosen by the content type."""

from __future__ import annotations

import httpx
import pytest

from tests.kube.accounts import ADMIN_TOKEN
from tests.kube.conftest import NAMESPACE, Cluster_
from tests.kube.fake.patch import PatchError, merge_patch, strategic_merge_patch

POD = "io.k8s.api.core.v1.Pod"
SECRET = "io.k8s.api.core.v1.Secret"
NODE = "io.k8s.api.core.v1.Node"
LEASE = "io.k8s.api.coordination.v1.Lease"


def owner(uid: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "name": f"p-{uid}", "uid": uid}


def container(name: str, **fields: object) -> dict:
    return {"name": name, "image": "i", **fields}


def condition(kind: str, status: str) -> dict:
    return {"type": kind, "status": status}


STRATEGIC = {
    "ownerReferences merge by uid": (
        SECRET,
        {"metadata": {"name": "s", "ownerReferences": [owner("a")]}},
        {"metadata": {"ownerReferences": [owner("b")]}},
        {"metadata": {"name": "s", "ownerReferences": [owner("a"), owner("b")]}},
    ),
    "an ownerReference with the same uid is merged into": (
        SECRET,
        {"metadata": {"name": "s", "ownerReferences": [owner("a")]}},
        {"metadata": {"ownerReferences": [{"uid": "a", "controller": True}]}},
        {"metadata": {"name": "s", "ownerReferences": [{**owner("a"), "controller": True}]}},
    ),
    "$patch: delete removes one element by its key": (
        SECRET,
        {"metadata": {"name": "s", "ownerReferences": [owner("a"), owner("b")]}},
        {"metadata": {"ownerReferences": [{"uid": "a", "$patch": "delete"}]}},
        {"metadata": {"name": "s", "ownerReferences": [owner("b")]}},
    ),
    "$patch: replace in a list makes it the rest": (
        SECRET,
        {"metadata": {"name": "s", "ownerReferences": [owner("a"), owner("b")]}},
        {"metadata": {"ownerReferences": [{"$patch": "replace"}, owner("c")]}},
        {"metadata": {"name": "s", "ownerReferences": [owner("c")]}},
    ),
    "labels merge; null removes one": (
        NODE,
        {"metadata": {"name": "n", "labels": {"a": "1", "b": "2"}}},
        {"metadata": {"labels": {"b": None, "c": "3"}}},
        {"metadata": {"name": "n", "labels": {"a": "1", "c": "3"}}},
    ),
    "$patch: replace in a map makes it the patch": (
        NODE,
        {"metadata": {"name": "n", "labels": {"a": "1", "b": "2"}}},
        {"metadata": {"labels": {"$patch": "replace", "c": "3"}}},
        {"metadata": {"name": "n", "labels": {"c": "3"}}},
    ),
    "$patch: delete in a map removes it": (
        NODE,
        {"metadata": {"name": "n", "labels": {"a": "1"}}},
        {"metadata": {"labels": {"$patch": "delete"}}},
        {"metadata": {"name": "n"}},
    ),
    "taints are atomic: replaced": (
        NODE,
        {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}},
        {"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}},
        {"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}},
    ),
    "pod conditions merge by type (a kubelet's status patch)": (
        POD,
        {"status": {"conditions": [condition("PodScheduled", "True"), condition("Ready", "False")]}},
        {"status": {"conditions": [condition("Ready", "True"), condition("Initialized", "True")]}},
        {
            "status": {
                "conditions": [
                    condition("PodScheduled", "True"),
                    condition("Ready", "True"),
                    condition("Initialized", "True"),
                ]
            }
        },
    ),
    "$setElementOrder orders the merged list": (
        POD,
        {"status": {"conditions": [condition("Ready", "False"), condition("PodScheduled", "True")]}},
        {
            "status": {
                "$setElementOrder/conditions": [{"type": "PodScheduled"}, {"type": "Ready"}],
                "conditions": [condition("Ready", "True")],
            }
        },
        {"status": {"conditions": [condition("PodScheduled", "True"), condition("Ready", "True")]}},
    ),
    "container statuses are atomic: replaced": (
        POD,
        {"status": {"containerStatuses": [{"name": "a", "ready": True}]}},
        {"status": {"containerStatuses": [{"name": "b", "ready": False}]}},
        {"status": {"containerStatuses": [{"name": "b", "ready": False}]}},
    ),
    "containers merge by name, and their env by name; args replace": (
        POD,
        {
            "spec": {
                "containers": [
                    container(
                        "a", args=["x", "y"], env=[{"name": "K", "value": "1"}, {"name": "L", "value": "2"}]
                    ),
                    container("b"),
                ]
            }
        },
        {"spec": {"containers": [{"name": "a", "args": ["z"], "env": [{"name": "L", "value": "3"}]}]}},
        {
            "spec": {
                "containers": [
                    container(
                        "a", args=["z"], env=[{"name": "K", "value": "1"}, {"name": "L", "value": "3"}]
                    ),
                    container("b"),
                ]
            }
        },
    ),
    "a new container is appended, its directives stripped": (
        POD,
        {"spec": {"containers": [container("a")]}},
        {"spec": {"containers": [{"name": "b", "image": "j", "env": [{"name": "K", "value": None}]}]}},
        {"spec": {"containers": [container("a"), {"name": "b", "image": "j", "env": [{"name": "K"}]}]}},
    ),
    "volumes merge by name": (
        POD,
        {"spec": {"volumes": [{"name": "a", "emptyDir": {}}]}},
        {"spec": {"volumes": [{"name": "b", "emptyDir": {}}]}},
        {"spec": {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "b", "emptyDir": {}}]}},
    ),
    "$retainKeys drops the keys it does not name": (
        POD,
        {"spec": {"volumes": [{"name": "a", "emptyDir": {}}]}},
        {
            "spec": {
                "volumes": [{"name": "a", "$retainKeys": ["name", "secret"], "secret": {"secretName": "s"}}]
            }
        },
        {"spec": {"volumes": [{"name": "a", "secret": {"secretName": "s"}}]}},
    ),
    "finalizers, a list of scalars, merge as a set": (
        SECRET,
        {"metadata": {"name": "s", "finalizers": ["a", "b"]}},
        {"metadata": {"finalizers": ["b", "c"]}},
        {"metadata": {"name": "s", "finalizers": ["a", "b", "c"]}},
    ),
    "$deleteFromPrimitiveList removes scalars": (
        SECRET,
        {"metadata": {"name": "s", "finalizers": ["a", "b"]}},
        {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}},
        {"metadata": {"name": "s", "finalizers": ["b"]}},
    ),
    "a Lease's holder cleared by null (leader election's release)": (
        LEASE,
        {"spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}},
        {"spec": {"holderIdentity": None}},
        {"spec": {"leaseDurationSeconds": 15}},
    ),
}


@pytest.mark.parametrize(("kind", "original", "patch", "result"), STRATEGIC.values(), ids=STRATEGIC.keys())
def test_strategic_merge_patch(kind: str, original: dict, patch: dict, result: dict) -> None:
    before = repr(original)
    assert strategic_merge_patch(original, patch, kind) == result
    assert repr(original) == before  # the original is left as it was


def test_a_merged_list_element_without_its_key_is_refused() -> None:
    with pytest.raises(PatchError, match="merge key 'uid'"):
        original = {"metadata": {"ownerReferences": [owner("a")]}}
        strategic_merge_patch(original, {"metadata": {"ownerReferences": [{"name": "x"}]}}, SECRET)


MERGE = {
    "lists replace whole": ({"a": [1, 2]}, {"a": [3]}, {"a": [3]}),
    "maps merge, null removes": (
        {"a": {"b": 1, "c": 2}},
        {"a": {"c": None, "d": 3}},
        {"a": {"b": 1, "d": 3}},
    ),
    "a scalar replaces a map": ({"a": {"b": 1}}, {"a": 2}, {"a": 2}),
    "a map patch on a scalar": ({"a": 1}, {"a": {"b": None, "c": 1}}, {"a": {"c": 1}}),
}


@pytest.mark.parametrize(("original", "patch", "result"), MERGE.values(), ids=MERGE.keys())
def test_json_merge_patch_is_rfc_7386(original: dict, patch: dict, result: dict) -> None:
    assert merge_patch(original, patch) == result


async def test_the_content_type_chooses_the_patch(cluster: Cluster_) -> None:
    """Two owners of one Secret (the nodes: owners that exist, or the collector would remove it): a
    strategic merge patch adds the second, a JSON merge patch replaces the list (what
    `KubeBackend._own_secret` relies on: one owner, written whole)."""
    a, b = (cluster.api.get("nodes", "", n)["metadata"]["uid"] for n in ("node-a", "node-b"))
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    base = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "ownerReferences": [owner(a)]}}
    add = {"metadata": {"ownerReferences": [owner(b)]}}
    async with httpx.AsyncClient(base_url=cluster.api.url, headers=auth) as http:
        assert (await http.post(base, json=secret)).status_code == 201
        strategic = {"content-type": "application/strategic-merge-patch+json"}
        merged = await http.patch(f"{base}/s", json=add, headers=strategic)
        assert [r["uid"] for r in merged.json()["metadata"]["ownerReferences"]] == [a, b]
        replaced = await http.patch(
            f"{base}/s", json=add, headers={"content-type": "application/merge-patch+json"}
        )
        assert [r["uid"] for r in replaced.json()["metadata"]["ownerReferences"]] == [b]
        json_patch = await http.patch(
            f"{base}/s", json=add, headers={"content-type": "application/json-patch+json"}
        )
        assert json_patch.status_code == 415 and json_patch.json()["reason"] == "UnsupportedMediaType"
