"""The `StokerDeployment` custom resource's definition: made from the deploy body's own schema, valid
as a CRD, structural, and naming every deploy field in Kubernetes' spelling both ways."""

from __future__ import annotations

import kubernetes_validate
import pytest

from stoker.errors import APIError
from stoker.spec.deployment import DEPLOY_FIELDS, FIELDS, default, deploy_schema, validate
from stoker.spec.engine import SETTINGS
from stoker.spec.resources import deployment_crd, from_resource, resource_name, structural, to_resource


def schema() -> dict:
    [version] = deployment_crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def nodes(s: dict, where: str = ""):
    yield where, s
    for key, child in s.get("properties", {}).items():
        yield from nodes(child, f"{where}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(s.get(key), dict):
            yield from nodes(s[key], f"{where}[{key}]")


def test_the_crd_is_valid_and_structural():
    kubernetes_validate.validate(deployment_crd(), "1.33.0", strict=True)
    for where, node in nodes(schema()):
        assert "type" in node, f"{where} has no type"
        assert not {"anyOf", "oneOf", "allOf", "not", "propertyNames"} & set(node), where
        assert not ("properties" in node and "additionalProperties" in node), where
        assert node.get("default", 0) is not None, where


def test_the_spec_holds_every_deploy_field_but_the_name_with_its_range_and_default():
    spec = schema()["properties"]["spec"]
    assert set(spec["properties"]) == {resource_name(f) for f in DEPLOY_FIELDS if f != "name"}
    assert "required" not in spec  # 'model', or 'adapter' with 'base': the controller's validate says which
    for field, (_, low, high) in FIELDS.items():
        node = spec["properties"][resource_name(field)]
        assert (node["minimum"], node["maximum"], node["default"]) == (low, high, default(field)), field
    for name, setting in SETTINGS.items():
        node = spec["properties"][resource_name(name)]
        assert node["nullable"] is True and node["type"] == structural(setting.schema)["type"], name
    share = spec["properties"]["gpuMemoryUtilization"]  # OpenAPI v3.0's exclusive bound
    assert (share["minimum"], share["exclusiveMinimum"], share["maximum"]) == (0, True, 1)
    assert spec["properties"]["engine"]["enum"] == deploy_schema()["properties"]["engine"]["enum"]


@pytest.mark.parametrize(
    ("field", "name"),
    [
        ("min_warm", "minWarm"),
        ("idle_timeout_s", "idleTimeoutSeconds"),
        ("rollback_ttft_s", "rollbackTtftSeconds"),
        ("gpu_memory_utilization", "gpuMemoryUtilization"),
        ("canary_percent", "canaryPercent"),
        ("max", "max"),
    ],
)
def test_fields_are_spelled_as_kubernetes_spells_them(field, name):
    assert resource_name(field) == name


def test_a_resource_is_the_deploy_body_it_was_made_from():
    body = {
        "name": "big",
        "model": "llama",
        "engine": "vllm",
        "gpus": 2,
        "max_model_len": 8192,
        "dtype": "bfloat16",
        "idle_timeout_s": 600.0,
        "node_selector": {"pool": "h200"},
    }
    spec = to_resource(body)
    assert "name" not in spec and spec["maxModelLen"] == 8192 and spec["idleTimeoutSeconds"] == 600.0
    assert from_resource("big", spec) == body
    assert validate(from_resource("big", spec)) == validate(body)
    # A field the resource does not know reaches validate by its own name, and is refused by it.
    with pytest.raises(APIError) as refused:
        validate(from_resource("big", {**spec, "replicas": 3}))
    assert refused.value.param == "replicas"


def test_status_and_columns_say_revision_traffic_ready_asleep_and_the_reason():
    [version] = deployment_crd()["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Revision": ".status.revision",
        "Traffic": ".status.trafficSummary",
        "Ready": ".status.ready",
        "Asleep": ".status.asleep",
        "Reason": ".status.lastReason",
        "Age": ".metadata.creationTimestamp",
    }
    condition = schema()["properties"]["status"]["properties"]["conditions"]["items"]
    assert set(condition["properties"]) >= {"type", "status", "reason", "message", "observedGeneration"}
