"""A deployment as a Kubernetes custom resource: the `StokerDeployment` CustomResourceDefinition,
made from the same deploy body schema the admin API validates with (`deploy_schema`: every field's
type, range and default written once), and the names the resource spells its fields with.

The resource's `spec` is the deploy body but for `name` (the resource's own `metadata.name`), in
Kubernetes' camelCase (`min_warm` → `minWarm`, a duration in seconds `idle_timeout_s` →
`idleTimeoutSeconds`; `to_resource`/`from_resource` turn one into the other, for every field). Its
`status` is the controller's: the revision it serves, the traffic split, READY and asleep counts,
the last reason, and conditions in Kubernetes' shape (`Ready`, `RolledOut`, with reasons, messages
and the generation they were observed at). `kubectl get stokerdeployments` prints the revision, the
split, READY, asleep and the last reason.

The schema is structural, as the API server requires: OpenAPI v3.0's spelling of what JSON Schema
2020-12 says in `deploy_schema` (`nullable` for a null alternative, boolean exclusive bounds), and
no `additionalProperties` beside `properties` (the API server prunes unknown fields instead). What a
structural schema cannot say (the label-key pattern of `nodeSelector`'s keys, the cross-field rules
such as min warm at most max, a passthrough argument Stoker manages) is checked where every deploy
is checked, `stoker.spec.deployment.validate`, when the controller takes the resource.
"""

from __future__ import annotations

import copy
from typing import Any

from stoker.spec.deployment import DEPLOY_FIELDS, deploy_schema

GROUP = "stoker.dev"
VERSION = "v1alpha1"
KIND = "StokerDeployment"
PLURAL = "stokerdeployments"


def resource_name(field: str) -> str:
    """A deploy field's name in the resource: camelCase, `_s` (seconds) spelled out."""
    if field.endswith("_s"):
        field = field[:-2] + "_seconds"
    head, *rest = field.split("_")
    return head + "".join(part.capitalize() for part in rest)


_FIELDS = [f for f in DEPLOY_FIELDS if f != "name"]  # the name is the resource's metadata.name
_TO_RESOURCE = {f: resource_name(f) for f in _FIELDS}
_FROM_RESOURCE = {v: k for k, v in _TO_RESOURCE.items()}
assert len(_FROM_RESOURCE) == len(_TO_RESOURCE), "two deploy fields with one resource name"


def to_resource(body: dict[str, Any]) -> dict[str, Any]:
    """A deploy body as a resource's `spec` (its `name` left out: that is the resource's)."""
    return {_TO_RESOURCE[k]: v for k, v in body.items() if k in _TO_RESOURCE}


def from_resource(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A resource's `spec` as the deploy body `stoker.spec.deployment.validate` checks; a field it
    does not know keeps its name, so that validate refuses it by that name."""
    return {"name": name, **{_FROM_RESOURCE.get(k, k): v for k, v in spec.items()}}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (JSON Schema 2020-12, as `deploy_schema` writes it) as a structural OpenAPI v3.0
    schema, as a CRD takes it."""
    s = copy.deepcopy(schema)
    if "anyOf" in s:
        alternatives = [a for a in s.pop("anyOf") if a != {"type": "null"}]
        if len(alternatives) != 1:
            raise ValueError(f"no structural form for anyOf {alternatives}")
        s = {**structural(alternatives[0]), **s, "nullable": True}
    if s.get("default", 0) is None:
        del s["default"]
    for bound, edge in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(s.get(bound), int | float) and not isinstance(s.get(bound), bool):
            s[edge], s[bound] = s[bound], True
    s.pop("propertyNames", None)  # not in a CRD's schema: validate checks label keys
    if "enum" in s and "type" not in s:
        s["type"] = "string"  # our enums are names
    if "properties" in s:
        s.pop("additionalProperties", None)  # the API server prunes unknown fields
        s["properties"] = {k: structural(v) for k, v in s["properties"].items()}
    elif isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = structural(s["additionalProperties"])
    if isinstance(s.get("items"), dict):
        s["items"] = structural(s["items"])
    return s


def _spec_schema() -> dict[str, Any]:
    body = deploy_schema()
    properties = {_TO_RESOURCE[k]: structural(v) for k, v in body["properties"].items() if k in _TO_RESOURCE}
    required = [_TO_RESOURCE[k] for k in body.get("required", []) if k in _TO_RESOURCE]
    return {"type": "object", "required": required, "properties": properties}


_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string", "enum": ["Ready", "RolledOut"]},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string", "maxLength": 1024},
        "message": {"type": "string", "maxLength": 32768},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer", "minimum": 0},
    },
}
_STATUS = {
    "type": "object",
    "properties": {
        "observedGeneration": {"type": "integer", "minimum": 0},
        "revision": {"type": "integer", "minimum": 0, "description": "the revision that serves most"},
        "traffic": {
            "type": "object",
            "description": "percent by revision",
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "trafficSummary": {
            "type": "string",
            "description": "the split as `kubectl get` prints it: 2=90%,3=10%",
        },
        "ready": {"type": "integer", "minimum": 0},
        "asleep": {"type": "integer", "minimum": 0},
        "lastReason": {"type": "string", "maxLength": 1024},
        "conditions": {
            "type": "array",
            "maxItems": 8,
            "items": _CONDITION,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    },
}
_COLUMNS = [
    {"name": "Revision", "type": "integer", "jsonPath": ".status.revision"},
    {"name": "Traffic", "type": "string", "jsonPath": ".status.trafficSummary"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.ready"},
    {"name": "Asleep", "type": "integer", "jsonPath": ".status.asleep"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.lastReason"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def deployment_crd() -> dict[str, Any]:
    """The `StokerDeployment` CustomResourceDefinition."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["sdeploy"],
                "categories": ["stoker"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A deployment of a model: what `stoker deploy` sets, as a resource.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": _spec_schema(),
                                "status": _STATUS,
                            },
                        }
                    },
                }
            ],
        },
    }


def crds() -> list[dict[str, Any]]:
    """Every CustomResourceDefinition Stoker defines: what `stoker crds` prints and the chart ships."""
    return [deployment_crd()]
