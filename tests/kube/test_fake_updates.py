"""What a write may change of a pod, on the fake as on the API server: a table of spec updates, and
the same over HTTP (a replace, strategic and JSON merge patches, the status subresource)."""

from __future__ import annotations

import copy

import httpx
import pytest

from tests.kube.accounts import ADMIN_TOKEN
from tests.kube.conftest import NAMESPACE, Cluster_
from tests.kube.fake.updates import UPDATABLE, pod_update_errors

FORBIDDEN = f"spec: Forbidden: pod updates may not change fields other than {UPDATABLE}"
SPEC = {
    "containers": [{"name": "c", "image": "i:1", "args": ["a"]}],
    "initContainers": [{"name": "pull", "image": "i:1"}],
    "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}],
    "activeDeadlineSeconds": 600,
}


def changed(**paths: object) -> dict:
    spec = copy.deepcopy(SPEC)
    for path, value in paths.items():
        *parents, last = path.split("__")
        at = spec
        for p in parents:
            at = at[int(p)] if p.isdigit() else at[p]
        if value is None:
            del at[last]
        else:
            at[last] = value
    return spec


UPDATES = {
    "an image": (changed(containers__0__image="i:2"), []),
    "an init container's image": (changed(initContainers__0__image="i:2"), []),
    "a toleration added": (
        changed(tolerations=[*SPEC["tolerations"], {"key": "j", "operator": "Exists"}]),
        [],
    ),
    "a toleration's seconds": (changed(tolerations__0__tolerationSeconds=60), []),
    "activeDeadlineSeconds lowered": (changed(activeDeadlineSeconds=60), []),
    "nothing": (changed(), []),
    "args": (changed(containers__0__args=["b"]), [FORBIDDEN]),
    "nodeName": (changed(nodeName="node-b"), [FORBIDDEN]),
    "a container added": (
        changed(containers=[*SPEC["containers"], {"name": "d", "image": "i"}]),
        ["spec.containers: Forbidden: pod updates may not add or remove containers"],
    ),
    "a toleration changed": (
        changed(tolerations=[{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]),
        ["spec.tolerations: Forbidden: existing toleration can not be modified except its tolerationSeconds"],
    ),
    "activeDeadlineSeconds raised": (
        changed(activeDeadlineSeconds=6000),
        ["spec.activeDeadlineSeconds: Invalid value: 6000: must be less than or equal to previous value"],
    ),
    "activeDeadlineSeconds removed": (
        changed(activeDeadlineSeconds=None),
        [
            "spec.activeDeadlineSeconds: Invalid value: null: must not update from a positive integer to nil value"
        ],
    ),
}


@pytest.mark.parametrize(("new", "errors"), UPDATES.values(), ids=UPDATES.keys())
def test_pod_spec_updates(new: dict, errors: list[str]) -> None:
    assert pod_update_errors(SPEC, new) == errors


def pod() -> dict:
    """A pod no node takes, so that nothing but the test writes it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"a": "1"}},
        "spec": {
            "containers": [{"name": "c", "image": "i:1", "command": ["missing"], "args": ["x"]}],
            "nodeSelector": {"pool": "none"},
        },
    }


async def test_a_pods_spec_is_immutable_over_http_but_for_what_kubernetes_allows(cluster: Cluster_) -> None:
    base = f"/api/v1/namespaces/{NAMESPACE}/pods"
    strategic = {"content-type": "application/strategic-merge-patch+json"}
    merge = {"content-type": "application/merge-patch+json"}
    async with httpx.AsyncClient(
        base_url=cluster.api.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as http:
        created = await http.post(base, json=pod())
        assert created.status_code == 201

        args = {"spec": {"containers": [{"name": "c", "args": ["y"]}]}}
        refused = await http.patch(f"{base}/p", json=args, headers=strategic)
        assert refused.status_code == 422 and refused.json()["reason"] == "Invalid"
        assert refused.json()["message"] == f'Pod "p" is invalid: {FORBIDDEN}'

        image = {"spec": {"containers": [{"name": "c", "image": "i:2"}]}}  # merged by name: args kept
        patched = await http.patch(f"{base}/p", json=image, headers=strategic)
        assert patched.status_code == 200, patched.text
        assert patched.json()["spec"]["containers"][0] == {
            "name": "c",
            "image": "i:2",
            "command": ["missing"],
            "args": ["x"],
        }

        whole = await http.patch(
            f"{base}/p", json=image, headers=merge
        )  # a JSON merge patch: the list replaced
        assert whole.status_code == 422 and "may not change fields" in whole.json()["message"]

        labels = await http.patch(f"{base}/p", json={"metadata": {"labels": {"b": "2"}}}, headers=merge)
        assert labels.json()["metadata"]["labels"] == {"a": "1", "b": "2"}  # metadata may change

        current = (await http.get(f"{base}/p")).json()
        replaced = copy.deepcopy(current)
        replaced["spec"]["containers"][0]["command"] = ["other"]
        assert (await http.put(f"{base}/p", json=replaced)).status_code == 422
        renamed = {**current, "metadata": {**current["metadata"], "name": "q"}}
        assert (await http.put(f"{base}/p", json=renamed)).status_code == 400

        status = {**current, "status": {"phase": "Succeeded"}}  # status is not the object's to change
        assert (await http.put(f"{base}/p", json=status)).json()["status"]["phase"] != "Succeeded"
        spec = {"spec": {"containers": [{"name": "c", "image": "i:3"}]}, "status": {"message": "m"}}
        answered = (await http.patch(f"{base}/p/status", json=spec, headers=strategic)).json()
        assert answered["status"]["message"] == "m" and answered["spec"]["containers"][0]["image"] == "i:2"
