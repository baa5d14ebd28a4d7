"""The fake API server serves custom resources as a real one does: a CRD is checked and
established, its objects are pruned, defaulted and validated against its schema, its status
subresource and `metadata.generation` behave as on a cluster, and RBAC covers them."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.kube.fake.apiserver import FakeApiServer
from tests.kube.fake.rbac import ADMIN, Policy, service_account

NS = "stoker"
ADMIN_AUTH = {"Authorization": "Bearer admin"}
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
WIDGETS = f"/apis/stoker.dev/v1/namespaces/{NS}/widgets"
MERGE = {"Content-Type": "application/merge-patch+json"}

SPEC_SCHEMA = {
    "type": "object",
    "required": ["gpus", "size"],
    "properties": {
        "gpus": {"type": "integer", "minimum": 1, "maximum": 64},
        "share": {"type": "number", "minimum": 0, "maximum": 1, "exclusiveMaximum": True},
        "size": {"type": "string", "enum": ["small", "large"]},
        "model": {"type": "string", "pattern": "^[a-z0-9-]+$", "minLength": 2, "maxLength": 12},
        "note": {"type": "string", "nullable": True},
        "port": {"x-kubernetes-int-or-string": True},
        "engine": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "default": "vllm"},
                "args": {"type": "array", "maxItems": 3, "items": {"type": "string"}},
            },
        },
        "tags": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 4}},
        "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "replicas": {"type": "integer", "default": 1},
    },
}
STATUS_SCHEMA = {
    "type": "object",
    "properties": {
        "ready": {"type": "integer"},
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {"type": {"type": "string"}, "status": {"type": "string"}},
            },
        },
    },
}


def widget_crd(schema: dict | None = None, **changes: object) -> dict:
    version = {
        "name": "v1",
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": schema
            or {"type": "object", "properties": {"spec": SPEC_SCHEMA, "status": STATUS_SCHEMA}}
        },
        "subresources": {"status": {}},
        "additionalPrinterColumns": [{"name": "GPUs", "type": "integer", "jsonPath": ".spec.gpus"}],
    }
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.stoker.dev"},
        "spec": {
            "group": "stoker.dev",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [version],
        },
    }
    for path, value in changes.items():  # "spec__names__plural": "gadgets"
        *parents, last = path.split("__")
        node = crd
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[last] = value
    return crd


def widget(name: str = "w", **spec: object) -> dict:
    return {
        "apiVersion": "stoker.dev/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"gpus": 2, "size": "small", **spec},
    }


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[FakeApiServer]:
    tokens = {"admin": ADMIN, "sa": service_account(NS, "widgets"), "other": service_account(NS, "other")}
    rbac = [
        {
            "kind": "Role",
            "metadata": {"name": "widgets", "namespace": NS},
            "rules": [
                {"apiGroups": ["stoker.dev"], "resources": ["widgets"], "verbs": ["get", "list", "create"]},
                {"apiGroups": ["stoker.dev"], "resources": ["widgets/status"], "verbs": ["update"]},
            ],
        },
        {
            "kind": "RoleBinding",
            "metadata": {"name": "widgets", "namespace": NS},
            "roleRef": {"kind": "Role", "name": "widgets"},
            "subjects": [{"kind": "ServiceAccount", "name": "widgets", "namespace": NS}],
        },
    ]
    server = FakeApiServer(tmp_path, tokens=tokens, policy=Policy.from_objects(rbac))
    server.add_namespace(NS)
    async with server.serve():
        yield server


@pytest.fixture
async def http(api: FakeApiServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN_AUTH) as client:
        assert (await client.post(CRDS, json=widget_crd())).status_code == 201
        yield client


async def test_a_registered_crd_is_established_and_its_kind_served(api: FakeApiServer) -> None:
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN_AUTH) as http:
        assert (await http.get(WIDGETS)).status_code == 404  # not before its CRD
        created = await http.post(CRDS, json=widget_crd())
        assert created.status_code == 201, created.text
        status = (await http.get(f"{CRDS}/widgets.stoker.dev")).json()["status"]
        listed = (await http.get(CRDS)).json()
        made = await http.post(WIDGETS, json=widget())
        everywhere = await http.get("/apis/stoker.dev/v1/widgets")
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert status["acceptedNames"]["kind"] == "Widget" and status["storedVersions"] == ["v1"]
    assert [c["metadata"]["name"] for c in listed["items"]] == ["widgets.stoker.dev"]
    assert made.status_code == 201, made.text
    assert made.json()["metadata"]["generation"] == 1 and made.json()["metadata"]["uid"]
    assert [w["metadata"]["name"] for w in everywhere.json()["items"]] == ["w"]
    assert everywhere.json()["kind"] == "WidgetList"


@pytest.mark.parametrize(
    ("crd", "message"),
    [
        (
            widget_crd(metadata={"name": "widgets.other.dev"}),
            'metadata.name: Invalid value: "widgets.other.dev": must be spec.names.plural+"."+spec.group',
        ),
        (
            widget_crd(spec__versions__0__storage=False),
            "spec.versions: Invalid value: 0: must have exactly one version marked as storage version",
        ),
        (
            widget_crd(spec__versions__0__schema={}),
            "spec.versions[0].schema.openAPIV3Schema: Required value: schemas are required",
        ),
        (
            widget_crd({"type": "object", "properties": {"spec": {"properties": {"a": {"type": "string"}}}}}),
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].type: Required value: "
            "must not be empty for specified object fields",
        ),
        (
            widget_crd({"type": "string"}),
            'spec.versions[0].schema.openAPIV3Schema.type: Invalid value: "string": must be object at the root',
        ),
        (
            widget_crd(
                {
                    "type": "object",
                    "properties": {"spec": {"type": "object", "anyOf": [{"type": "object"}]}},
                }
            ),
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].anyOf[0].type: "
            "Forbidden: must be empty to be structural",
        ),
        (
            widget_crd(
                {
                    "type": "object",
                    "properties": {
                        "spec": {"type": "object", "oneOf": [{"properties": {"x": {"type": "string"}}}]}
                    },
                }
            ),
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].oneOf[0].properties[x]: "
            "Required value: must be specified outside the junctor",
        ),
        (
            widget_crd({"type": "object", "properties": {"spec": {"type": "array"}}}),
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].items: Required value: must be specified",
        ),
    ],
    ids=["name", "storage", "no-schema", "untyped", "root-type", "anyOf-type", "oneOf-unspecified", "items"],
)
async def test_a_crd_the_server_refuses_is_422_and_not_served(
    api: FakeApiServer, crd: dict, message: str
) -> None:
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN_AUTH) as http:
        answer = await http.post(CRDS, json=crd)
        assert (await http.get(WIDGETS)).status_code == 404
    assert answer.status_code == 422 and answer.json()["reason"] == "Invalid", answer.text
    assert message in answer.json()["message"]
    assert answer.json()["message"].startswith(
        f'CustomResourceDefinition.apiextensions.k8s.io "{crd["metadata"]["name"]}"'
    )


async def test_a_crd_is_checked_against_the_official_schema_strictly(api: FakeApiServer) -> None:
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN_AUTH) as http:
        answer = await http.post(CRDS, json=widget_crd(spec__scope="Namespaced", spec__sope="x"))
    assert answer.status_code == 422 and "sope" in answer.json()["message"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"gpus": 99}, "spec.gpus: Invalid value: 99: spec.gpus in body should be less than or equal to 64"),
        ({"gpus": 0}, "spec.gpus: Invalid value: 0: spec.gpus in body should be greater than or equal to 1"),
        ({"share": 1}, "spec.share: Invalid value: 1: spec.share in body should be less than 1"),
        (
            {"gpus": "two"},
            'spec.gpus: Invalid value: "string": spec.gpus in body must be of type integer: "string"',
        ),
        ({"size": "huge"}, 'spec.size: Unsupported value: "huge": supported values: "small", "large"'),
        (
            {"model": "Big_One"},
            "spec.model: Invalid value: \"Big_One\": spec.model in body should match '^[a-z0-9-]+$'",
        ),
        (
            {"model": "a"},
            'spec.model: Invalid value: "a": spec.model in body should be at least 2 chars long',
        ),
        ({"model": "a-very-long-model"}, "spec.model: Too long: may not be more than 12 bytes"),
        (
            {"engine": {"args": ["a", "b", "c", "d"]}},
            "spec.engine.args: Too many: 4: must have at most 3 items",
        ),
        ({"tags": []}, "spec.tags: Invalid value: 0: spec.tags in body should have at least 1 items"),
        ({"labels": {"team": "platform"}}, "spec.labels.team: Too long: may not be more than 4 bytes"),
        ({"port": True}, "spec.port: Invalid value:"),
        ({"size": None}, "spec.size: Required value"),  # null is dropped, then it is missing
    ],
    ids=[
        "maximum",
        "minimum",
        "exclusiveMaximum",
        "type",
        "enum",
        "pattern",
        "minLength",
        "maxLength",
        "maxItems",
        "minItems",
        "additionalProperties",
        "int-or-string",
        "null-dropped",
    ],
)
async def test_a_custom_resource_against_its_schema_is_422_in_the_servers_words(
    api: FakeApiServer, http: httpx.AsyncClient, spec: dict, message: str
) -> None:
    answer = await http.post(WIDGETS, json=widget(**spec))
    assert answer.status_code == 422 and answer.json()["reason"] == "Invalid", answer.text
    assert answer.json()["message"].startswith('Widget.stoker.dev "w" is invalid: ')
    assert message in answer.json()["message"]
    assert api.get("widgets.stoker.dev", NS, "w") is None


async def test_several_errors_are_listed_in_one_message(http: httpx.AsyncClient) -> None:
    answer = await http.post(WIDGETS, json=widget(gpus=99, size="huge"))
    assert answer.json()["message"] == (
        'Widget.stoker.dev "w" is invalid: [spec.gpus: Invalid value: 99: spec.gpus in body should be '
        'less than or equal to 64, spec.size: Unsupported value: "huge": supported values: "small", "large"]'
    )


async def test_unknown_fields_are_pruned_and_defaults_applied(http: httpx.AsyncClient) -> None:
    sent = widget(
        typo=1,
        note=None,
        port="http",
        engine={"args": ["x"], "colour": "red"},
        extra={"anything": {"goes": [1]}},
    )
    sent["topLevel"] = "gone"
    made = (await http.post(WIDGETS, json=sent)).json()
    assert "topLevel" not in made
    assert made["spec"] == {
        "gpus": 2,
        "size": "small",
        "note": None,  # nullable: kept
        "port": "http",
        "engine": {"name": "vllm", "args": ["x"]},  # defaulted inside, unknown pruned
        "extra": {"anything": {"goes": [1]}},  # preserved
        "replicas": 1,
    }
    patched = await http.patch(
        f"{WIDGETS}/w", json={"spec": {"replicas": None, "engine": None}}, headers=MERGE
    )
    assert patched.status_code == 200, patched.text
    assert (
        patched.json()["spec"]["replicas"] == 1 and "engine" not in patched.json()["spec"]
    )  # defaulted again


async def test_replace_patch_delete_conflict_and_strategic_merge(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    made = (await http.post(WIDGETS, json=widget())).json()
    assert (await http.post(WIDGETS, json=widget())).json()["reason"] == "AlreadyExists"
    changed = copy.deepcopy(made)
    changed["spec"]["gpus"] = 4
    replaced = await http.put(f"{WIDGETS}/w", json=changed)
    assert replaced.status_code == 200 and replaced.json()["spec"]["gpus"] == 4
    stale = await http.put(f"{WIDGETS}/w", json=changed)
    assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"
    merged = await http.patch(f"{WIDGETS}/w", json={"spec": {"size": "large"}}, headers=MERGE)
    assert merged.json()["spec"] == {**replaced.json()["spec"], "size": "large"}
    invalid = await http.patch(f"{WIDGETS}/w", json={"spec": {"gpus": 65}}, headers=MERGE)
    assert invalid.status_code == 422
    strategic = await http.patch(
        f"{WIDGETS}/w",
        json={"spec": {"size": "large"}},
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    assert strategic.status_code == 415 and strategic.json()["reason"] == "UnsupportedMediaType"
    assert (await http.delete(f"{WIDGETS}/w")).status_code == 200
    assert (await http.get(f"{WIDGETS}/w")).status_code == 404
    assert api.get("widgets.stoker.dev", NS, "w") is None


async def test_status_and_spec_writes_and_the_generation(http: httpx.AsyncClient) -> None:
    sent = widget()
    sent["status"] = {"ready": 5}
    made = (await http.post(WIDGETS, json=sent)).json()
    assert "status" not in made and made["metadata"]["generation"] == 1  # a create never sets status

    status = {**made, "spec": {"gpus": 64, "size": "large"}, "status": {"ready": 1}}
    written = (await http.put(f"{WIDGETS}/w/status", json=status)).json()
    assert written["status"] == {"ready": 1}
    assert written["spec"] == made["spec"]  # a status write ignores the spec
    assert written["metadata"]["generation"] == 1  # and does not bump the generation

    main = {**written, "spec": {**written["spec"], "gpus": 3}, "status": {"ready": 9}}
    replaced = (await http.put(f"{WIDGETS}/w", json=main)).json()
    assert replaced["status"] == {"ready": 1}  # a write of the object ignores its status
    assert replaced["spec"]["gpus"] == 3 and replaced["metadata"]["generation"] == 2

    labelled = await http.patch(f"{WIDGETS}/w", json={"metadata": {"labels": {"a": "b"}}}, headers=MERGE)
    assert labelled.json()["metadata"]["labels"] == {"a": "b"}
    assert labelled.json()["metadata"]["generation"] == 2  # metadata only: no bump
    patched = await http.patch(
        f"{WIDGETS}/w/status",
        json={"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
        headers=MERGE,
    )
    assert patched.json()["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    assert patched.json()["metadata"]["generation"] == 2
    bad = await http.patch(
        f"{WIDGETS}/w/status", json={"status": {"conditions": [{"type": "X"}]}}, headers=MERGE
    )
    assert bad.status_code == 422 and "status.conditions[0].status: Required value" in bad.json()["message"]


async def test_without_the_status_subresource_status_is_part_of_the_object(api: FakeApiServer) -> None:
    crd = widget_crd()
    del crd["spec"]["versions"][0]["subresources"]
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN_AUTH) as http:
        assert (await http.post(CRDS, json=crd)).status_code == 201
        sent = widget()
        sent["status"] = {"ready": 5}
        made = (await http.post(WIDGETS, json=sent)).json()
        assert made["status"] == {"ready": 5}
        assert (await http.put(f"{WIDGETS}/w/status", json=made)).status_code == 404
        patched = await http.patch(f"{WIDGETS}/w", json={"status": {"ready": 6}}, headers=MERGE)
    assert patched.json()["status"] == {"ready": 6} and patched.json()["metadata"]["generation"] == 2


async def test_watch_events_and_a_deleted_crd_takes_its_resources(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    start = (await http.get(WIDGETS)).json()["metadata"]["resourceVersion"]
    await http.post(WIDGETS, json=widget())
    await http.patch(f"{WIDGETS}/w", json={"spec": {"gpus": 3}}, headers=MERGE)
    events = []
    params = {"watch": "true", "resourceVersion": start, "timeoutSeconds": "5"}
    async with http.stream("GET", WIDGETS, params=params) as watch:
        async for line in watch.aiter_lines():
            events.append(json.loads(line))
            if len(events) == 2:  # the CRD goes while the watch is open: its objects with it
                assert (await http.delete(f"{CRDS}/widgets.stoker.dev")).status_code == 200
            if len(events) == 3:
                break
    assert [(e["type"], e["object"]["spec"]["gpus"]) for e in events] == [
        ("ADDED", 2),
        ("MODIFIED", 3),
        ("DELETED", 3),
    ]
    assert (await http.get(WIDGETS)).status_code == 404
    assert api.get("widgets.stoker.dev", NS, "w") is None


async def test_rbac_covers_custom_resources_and_their_status(
    api: FakeApiServer, http: httpx.AsyncClient
) -> None:
    made = (await http.post(WIDGETS, json=widget())).json()
    async with (
        httpx.AsyncClient(base_url=api.url, headers={"Authorization": "Bearer sa"}) as sa,
        httpx.AsyncClient(base_url=api.url, headers={"Authorization": "Bearer other"}) as other,
    ):
        assert (await sa.get(f"{WIDGETS}/w")).status_code == 200
        assert (await sa.post(WIDGETS, json=widget("v"))).status_code == 201
        assert (await sa.put(f"{WIDGETS}/w/status", json={**made, "status": {"ready": 1}})).status_code == 200
        refused = await sa.put(f"{WIDGETS}/w", json=made)  # update on widgets itself is not granted
        stranger = await other.get(f"{WIDGETS}/w")
    assert refused.status_code == 403
    assert refused.json()["message"] == (
        'widgets.stoker.dev "w" is forbidden: User "system:serviceaccount:stoker:widgets" cannot update '
        'resource "widgets" in API group "stoker.dev" in the namespace "stoker"'
    )
    assert stranger.status_code == 403
    calls = [
        (c.attrs.verb, c.attrs.group, c.attrs.full_resource, c.allowed)
        for c in api.calls
        if c.user.endswith(":widgets")
    ]
    assert ("update", "stoker.dev", "widgets/status", True) in calls


async def test_a_crd_replaced_is_served_with_its_new_schema(http: httpx.AsyncClient) -> None:
    assert (await http.post(WIDGETS, json=widget(gpus=99))).status_code == 422
    current = (await http.get(f"{CRDS}/widgets.stoker.dev")).json()
    current["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["gpus"][
        "maximum"
    ] = 128
    replaced = await http.put(f"{CRDS}/widgets.stoker.dev", json=current)
    assert replaced.status_code == 200 and replaced.json()["metadata"]["generation"] == 2
    assert (await http.post(WIDGETS, json=widget(gpus=99))).status_code == 201


async def test_the_stoker_deployment_crd_is_served_and_its_resource_is_the_deploy_body(
    api: FakeApiServer,
) -> None:
    """Stoker's own definition (`stoker.spec.resources`), made from the deploy body's schema: the
    server takes it as structural, defaults a resource as the spec defaults a deploy, refuses what
    the spec's ranges refuse, and what it keeps is the deploy body `validate` checks."""
    from stoker.spec.deployment import default, validate
    from stoker.spec.resources import GROUP, PLURAL, VERSION, deployment_crd, from_resource

    path = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
    resource = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "StokerDeployment",
        "metadata": {"name": "big"},
        "spec": {"model": "llama", "engine": "vllm", "gpus": 2, "maxModelLen": 8192, "replicas": 3},
    }
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN_AUTH) as http:
        registered = await http.post(CRDS, json=deployment_crd())
        assert registered.status_code == 201, registered.text
        made = await http.post(path, json=resource)
        assert made.status_code == 201, made.text
        too_many = await http.post(
            path, json={**resource, "metadata": {"name": "huge"}, "spec": {"model": "m", "gpus": 65}}
        )
    spec = made.json()["spec"]
    assert "replicas" not in spec  # pruned: the server keeps only what the schema names
    assert spec["minWarm"] == default("min_warm") and spec["idleTimeoutSeconds"] == default("idle_timeout_s")
    body = validate(from_resource("big", spec))
    assert (body["gpus"], body["max_model_len"], body["engine"]) == (2, 8192, "vllm")
    assert too_many.status_code == 422 and "spec.gpus" in too_many.json()["message"], too_many.text
