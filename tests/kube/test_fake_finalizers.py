"""The fake API server holds an object with finalizers as a real one does: a delete marks it
terminating, an update that leaves no finalizers removes it, no finalizer is added meanwhile, and
the garbage collector and a CRD's deletion wait for them."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from tests.kube import test_fake_crds
from tests.kube.fake.apiserver import FakeApiServer
from tests.kube.test_fake_crds import CRDS, MERGE, NS, WIDGETS, widget

api = test_fake_crds.api  # its fixtures: the server with namespace `stoker`, and a client with Widget's CRD
http = test_fake_crds.http

DRAIN = "stoker.dev/drain"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
PODS = f"/api/v1/namespaces/{NS}/pods"
WIDGET = "widgets.stoker.dev"
DEFINITIONS = "customresourcedefinitions.apiextensions.k8s.io"


def with_finalizers(obj: dict, *names: str) -> dict:
    obj["metadata"]["finalizers"] = list(names)
    return obj


def secret(name: str = "s", *finalizers: str, owners: list[dict] | None = None) -> dict:
    meta: dict = {"name": name, "finalizers": list(finalizers)}
    if owners:
        meta["ownerReferences"] = owners
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta}


def owner_ref(obj: dict) -> dict:
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"], "uid": meta["uid"]}


async def test_a_resource_with_a_finalizer_terminates_until_an_update_leaves_none(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    made = (await http.post(WIDGETS, json=with_finalizers(widget(), DRAIN))).json()
    params = {"watch": "true", "resourceVersion": made["metadata"]["resourceVersion"], "timeoutSeconds": "5"}
    async with http.stream("GET", WIDGETS, params=params) as watch:
        deleted = await http.delete(f"{WIDGETS}/w")
        again = await http.delete(f"{WIDGETS}/w")
        changed = await http.patch(f"{WIDGETS}/w", json={"spec": {"gpus": 3}}, headers=MERGE)
        status = await http.patch(
            f"{WIDGETS}/w/status",
            json={"metadata": {"finalizers": []}, "status": {"ready": 1}},
            headers=MERGE,
        )  # status only: its finalizers stay
        still = copy.deepcopy(api.get(WIDGET, NS, "w"))
        assert still is not None
        finished = await http.patch(f"{WIDGETS}/w", json={"metadata": {"finalizers": []}}, headers=MERGE)
        lines = watch.aiter_lines()
        events = [json.loads(await anext(lines)) for _ in range(4)]
        gone = await http.get(f"{WIDGETS}/w")
    assert deleted.status_code == 200, deleted.text
    meta = deleted.json()["metadata"]
    assert meta["deletionTimestamp"] and meta["deletionGracePeriodSeconds"] == 0
    assert meta["finalizers"] == [DRAIN]
    assert int(meta["resourceVersion"]) > int(made["metadata"]["resourceVersion"])
    assert again.status_code == 200 and again.json() == deleted.json()  # nothing changed
    assert changed.status_code == 200 and changed.json()["spec"]["gpus"] == 3
    assert changed.json()["metadata"]["generation"] == 2  # spec changes go through while terminating
    assert changed.json()["metadata"]["deletionTimestamp"] == meta["deletionTimestamp"]
    assert status.status_code == 200 and still["status"] == {"ready": 1} and still["metadata"]["finalizers"]
    assert finished.status_code == 200, finished.text
    assert finished.json()["metadata"]["finalizers"] == [] and finished.json()["spec"]["gpus"] == 3
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    assert events[0]["object"]["metadata"]["deletionTimestamp"] == meta["deletionTimestamp"]
    assert (
        events[3]["object"]["metadata"]["resourceVersion"] == finished.json()["metadata"]["resourceVersion"]
    )
    assert gone.status_code == 404 and api.get(WIDGET, NS, "w") is None


async def test_a_replace_of_a_terminating_object_with_a_stale_version_is_409(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    made = (await http.post(WIDGETS, json=with_finalizers(widget(), DRAIN))).json()
    assert (await http.delete(f"{WIDGETS}/w")).status_code == 200
    stale = await http.put(f"{WIDGETS}/w", json=with_finalizers(made, *[]))
    assert stale.status_code == 409 and stale.json()["reason"] == "Conflict", stale.text
    left = api.get(WIDGET, NS, "w")
    assert left is not None and left["metadata"]["finalizers"] == [DRAIN]


async def test_no_finalizer_is_added_while_terminating_and_the_deletion_timestamp_is_the_servers(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    live = (await http.post(WIDGETS, json=widget("live"))).json()
    forged = await http.patch(
        f"{WIDGETS}/live", json={"metadata": {"deletionTimestamp": "2000-01-01T00:00:00Z"}}, headers=MERGE
    )
    assert forged.status_code == 200 and "deletionTimestamp" not in forged.json()["metadata"]
    assert "deletionTimestamp" not in api.get(WIDGET, NS, "live")["metadata"], live

    await http.post(WIDGETS, json=with_finalizers(widget(), DRAIN))
    stamp = (await http.delete(f"{WIDGETS}/w")).json()["metadata"]["deletionTimestamp"]
    added = await http.patch(
        f"{WIDGETS}/w", json={"metadata": {"finalizers": [DRAIN, "stoker.dev/b", "a.dev/a"]}}, headers=MERGE
    )
    moved = await http.patch(
        f"{WIDGETS}/w", json={"metadata": {"deletionTimestamp": "2000-01-01T00:00:00Z"}}, headers=MERGE
    )
    assert added.status_code == 422 and added.json()["reason"] == "Invalid", added.text
    assert added.json()["message"] == (
        'Widget.stoker.dev "w" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added '
        'if the object is being deleted, found new finalizers []string{"a.dev/a", "stoker.dev/b"}'
    )
    assert moved.status_code == 200 and moved.json()["metadata"]["deletionTimestamp"] == stamp
    assert api.get(WIDGET, NS, "w")["metadata"]["finalizers"] == [DRAIN]


@pytest.mark.parametrize(
    ("path", "obj", "message"),
    [
        (
            WIDGETS,
            with_finalizers(widget(), "stoker.dev/has space"),
            'Widget.stoker.dev "w" is invalid: metadata.finalizers: Invalid value: "stoker.dev/has space": '
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
            "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
            "validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')",
        ),
        (
            WIDGETS,
            with_finalizers(widget(), "Stoker.dev/drain"),
            'Widget.stoker.dev "w" is invalid: metadata.finalizers: Invalid value: "Stoker.dev/drain": '
            "prefix part a lowercase RFC 1123 subdomain must consist of",
        ),
        (
            SECRETS,
            secret("w", "drain"),
            'Secret "w" is invalid: metadata.finalizers[0]: Invalid value: "drain": '
            "name is neither a standard finalizer name nor is it fully qualified",
        ),
    ],
    ids=["name-part", "prefix", "bare-on-a-built-in-kind"],
)
async def test_a_finalizer_that_is_not_a_qualified_name_is_422(
    api: FakeApiServer, http: httpx.AsyncClient, path: str, obj: dict, message: str
) -> None:
    answer = await http.post(path, json=obj)
    assert answer.status_code == 422 and answer.json()["reason"] == "Invalid", answer.text
    assert answer.json()["message"].startswith(message)
    assert api.get(WIDGET, NS, "w") is None and api.get("secrets", NS, "w") is None
    assert (await http.post(WIDGETS, json=widget())).status_code == 201
    renamed = await http.patch(f"{WIDGETS}/w", json={"metadata": {"finalizers": ["a b"]}}, headers=MERGE)
    assert renamed.status_code == 422 and "metadata.finalizers: Invalid value" in renamed.json()["message"]


async def test_standard_and_bare_finalizers_where_a_real_server_takes_them(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    standard = await http.post(SECRETS, json=secret("s", "kubernetes", "foregroundDeletion"))
    bare = await http.post(WIDGETS, json=with_finalizers(widget(), "drain"))  # a real server warns
    assert standard.status_code == 201, standard.text
    assert bare.status_code == 201, bare.text
    assert api.get("secrets", NS, "s")["metadata"]["finalizers"] == ["kubernetes", "foregroundDeletion"]
    assert api.get(WIDGET, NS, "w")["metadata"]["finalizers"] == ["drain"]


async def test_a_secret_with_a_finalizer_terminates_and_a_replace_without_it_removes_it(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    assert (await http.post(SECRETS, json=secret("s", DRAIN))).status_code == 201
    deleted = (await http.delete(f"{SECRETS}/s")).json()
    assert (
        api.get("secrets", NS, "s")["metadata"]["deletionTimestamp"]
        == deleted["metadata"]["deletionTimestamp"]
    )
    kept = await http.put(f"{SECRETS}/s", json={**deleted, "data": {"k": "dg=="}})
    assert kept.status_code == 200 and api.get("secrets", NS, "s")["data"] == {"k": "dg=="}
    replaced = await http.put(f"{SECRETS}/s", json=with_finalizers(kept.json(), *[]))
    assert replaced.status_code == 200 and replaced.json()["data"] == {"k": "dg=="}
    assert api.get("secrets", NS, "s") is None
    assert (await http.get(f"{SECRETS}/s")).status_code == 404


async def test_the_garbage_collector_marks_an_owned_object_with_finalizers_and_a_terminating_owner_counts(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    owner = (await http.post(SECRETS, json=secret("owner"))).json()
    held = (await http.post(SECRETS, json=secret("held", DRAIN, owners=[owner_ref(owner)]))).json()
    assert held["metadata"]["uid"]
    assert (await http.delete(f"{SECRETS}/owner")).status_code == 200
    assert api.get("secrets", NS, "owner") is None
    left = api.get("secrets", NS, "held")
    assert left is not None and left["metadata"]["deletionTimestamp"]  # marked, not removed
    await http.patch(f"{SECRETS}/held", json={"metadata": {"finalizers": []}}, headers=MERGE)
    assert api.get("secrets", NS, "held") is None

    parent = (await http.post(SECRETS, json=secret("parent", DRAIN))).json()
    await http.post(SECRETS, json=secret("child", owners=[owner_ref(parent)]))
    await http.delete(f"{SECRETS}/parent")
    assert api.get("secrets", NS, "parent")["metadata"]["deletionTimestamp"]
    assert api.get("secrets", NS, "child") is not None  # its owner still exists, terminating
    await http.patch(f"{SECRETS}/parent", json={"metadata": {"finalizers": []}}, headers=MERGE)
    assert api.get("secrets", NS, "parent") is None and api.get("secrets", NS, "child") is None


async def test_a_pod_with_a_finalizer_and_no_node_is_not_removed_at_once(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    def pod(name: str, *finalizers: str) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "finalizers": list(finalizers)},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        }

    for made in (pod("plain"), pod("held", DRAIN)):
        assert (await http.post(PODS, json=made)).status_code == 201, made
        assert (await http.delete(f"{PODS}/{made['metadata']['name']}")).status_code == 200
    assert api.get("pods", NS, "plain") is None  # not bound: grace 0
    held = api.get("pods", NS, "held")
    assert held is not None and not held["spec"].get("nodeName")
    assert held["metadata"]["deletionTimestamp"] and held["metadata"]["deletionGracePeriodSeconds"] == 0
    again = await http.delete(f"{PODS}/held", params={"gracePeriodSeconds": "0"})
    assert again.status_code == 200 and api.get("pods", NS, "held") is not None
    await http.patch(f"{PODS}/held", json={"metadata": {"finalizers": []}}, headers=MERGE)
    assert api.get("pods", NS, "held") is None


async def test_a_deleted_crd_waits_for_its_resources_finalizers(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    await http.post(WIDGETS, json=widget("plain"))
    await http.post(WIDGETS, json=with_finalizers(widget("held"), DRAIN))
    deleted = await http.delete(f"{CRDS}/{WIDGET}")
    assert deleted.status_code == 200 and deleted.json()["metadata"]["deletionTimestamp"]
    definition = api.get(DEFINITIONS, "", WIDGET)
    assert definition is not None
    conditions = {c["type"]: (c["status"], c["reason"]) for c in definition["status"]["conditions"]}
    assert conditions["Terminating"] == ("True", "InstanceDeletionInProgress")
    assert api.get(WIDGET, NS, "plain") is None
    assert api.get(WIDGET, NS, "held")["metadata"]["deletionTimestamp"]
    created = await http.post(WIDGETS, json=widget("new"))
    assert created.status_code == 405, created.text
    assert created.json()["message"] == "create not allowed while custom resource definition is terminating"
    assert (await http.get(f"{WIDGETS}/held")).status_code == 200

    finished = await http.patch(f"{WIDGETS}/held", json={"metadata": {"finalizers": []}}, headers=MERGE)
    assert finished.status_code == 200, finished.text
    assert api.get(DEFINITIONS, "", WIDGET) is None
    assert (await http.get(f"{CRDS}/{WIDGET}")).status_code == 404
    assert (await http.get(WIDGETS)).status_code == 404
