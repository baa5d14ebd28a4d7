"""Stoker's Kubernetes custom resources: their CustomResourceDefinitions, made from the same schemas
the admin API validates with (`deploy_schema`, `route_schema`: every field's type, range and default
written once), and the names the resources spell their fields with.

    StokerDeployment  a deployment: what `stoker deploy` sets (spec), what the controller serves (status)
    StokerRevision    one revision of a deployment, immutable: its settings and the snapshot it resolved
                      to; written by the controller, owned by its StokerDeployment (deleted with it)
    StokerRoute       a cascade route: a name answered by a small deployment, escalating to a large one

Tenant keys are not a custom resource but Secrets (`stoker.control.kube.keys` says why).

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
import re
from typing import Any

from stoker.spec.deployment import DEPLOY_FIELDS, deploy_schema
from stoker.spec.routes import FIELDS as ROUTE_FIELDS
from stoker.spec.routes import route_schema

GROUP = "stoker.dev"
VERSION = "v1alpha1"
KIND = "StokerDeployment"
PLURAL = "stokerdeployments"
REVISION_KIND, REVISION_PLURAL = "StokerRevision", "stokerrevisions"
ROUTE_KIND, ROUTE_PLURAL = "StokerRoute", "stokerroutes"
# What a Kubernetes object's name may be (a DNS subdomain), which is narrower than a Stoker name:
# no `_`, and no `-` or `.` at the end.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def object_name_error(name: str, what: str = "deployment") -> str | None:
    """Why `name` (a valid Stoker name) cannot name a resource on a cluster, or None."""
    if _OBJECT_NAME.fullmatch(name) and len(name) <= 63:
        return None
    return (
        f"on Kubernetes a {what}'s name is its resource's name: lowercase letters, digits, '-' and '.', "
        f"starting and ending with a letter or digit (no '_'); got {name!r}"
    )


def revision_object_name(deployment: str, revision: int) -> str:
    """A StokerRevision's name: `<deployment>-r<revision>` (unique: the suffix is read from the end)."""
    return f"{deployment}-r{revision}"


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


_ROUTE_TO = {f: resource_name(f) for f in ROUTE_FIELDS if f != "name"}
_ROUTE_FROM = {v: k for k, v in _ROUTE_TO.items()}


def to_resource(body: dict[str, Any]) -> dict[str, Any]:
    """A deploy body as a resource's `spec` (its `name` left out: that is the resource's)."""
    return {_TO_RESOURCE[k]: v for k, v in body.items() if k in _TO_RESOURCE}


def from_resource(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A resource's `spec` as the deploy body `stoker.spec.deployment.validate` checks; a field it
    does not know keeps its name, so that validate refuses it by that name."""
    return {"name": name, **{_FROM_RESOURCE.get(k, k): v for k, v in spec.items()}}


def route_to_resource(route: dict[str, Any]) -> dict[str, Any]:
    """A route (`CascadeRoute.to_dict`) as a StokerRoute's `spec`."""
    return {_ROUTE_TO[k]: v for k, v in route.items() if k in _ROUTE_TO}


def route_from_resource(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A StokerRoute's `spec` as the body `stoker.spec.routes.validate_route` checks."""
    return {"name": name, **{_ROUTE_FROM.get(k, k): v for k, v in spec.items()}}


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


def _spec_schema(body: dict[str, Any] | None = None, names: dict[str, str] = _TO_RESOURCE) -> dict[str, Any]:
    body = body or deploy_schema()
    properties = {names[k]: structural(v) for k, v in body["properties"].items() if k in names}
    required = [names[k] for k in body.get("required", []) if k in names]
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:  # an empty list is not a schema's `required`
        out["required"] = required
    return out


def _revision_schema() -> dict[str, Any]:
    """A StokerRevision's spec: the deploy fields as the revision took them, with its number, its
    deployment and the snapshot its model resolved to."""
    spec = _spec_schema()
    spec["properties"] = {
        "deployment": {"type": "string", "maxLength": 63},
        "revision": {"type": "integer", "minimum": 1},
        "snapshotId": {"type": "string", "minLength": 1, "maxLength": 128},
        **spec["properties"],
    }
    spec["required"] = ["deployment", "revision", "snapshotId", *spec.get("required", [])]
    return spec


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


def _crd(
    kind: str,
    plural: str,
    short: str,
    description: str,
    spec: dict[str, Any],
    columns: list[dict[str, str]],
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": spec,
    }
    version: dict[str, Any] = {"name": VERSION, "served": True, "storage": True}
    if status is not None:
        properties["status"] = status
        version["subresources"] = {"status": {}}
    version["additionalPrinterColumns"] = columns
    version["schema"] = {
        "openAPIV3Schema": {
            "type": "object",
            "description": description,
            "required": ["spec"],
            "properties": properties,
        }
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short],
                "categories": ["stoker"],
            },
            "versions": [version],
        },
    }


def deployment_crd() -> dict[str, Any]:
    """The `StokerDeployment` CustomResourceDefinition."""
    return _crd(
        KIND,
        PLURAL,
        "sdeploy",
        "A deployment of a model: what `stoker deploy` sets, as a resource.",
        _spec_schema(),
        _COLUMNS,
        _STATUS,
    )


def revision_crd() -> dict[str, Any]:
    """The `StokerRevision` CustomResourceDefinition: written by the controller only."""
    columns = [
        {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
        {"name": "Revision", "type": "integer", "jsonPath": ".spec.revision"},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd(
        REVISION_KIND,
        REVISION_PLURAL,
        "srev",
        "One revision of a StokerDeployment, as the controller made it: immutable.",
        _revision_schema(),
        columns,
    )


def route_crd() -> dict[str, Any]:
    """The `StokerRoute` CustomResourceDefinition: a cascade route, what `stoker route` sets."""
    columns = [
        {"name": "Small", "type": "string", "jsonPath": ".spec.small"},
        {"name": "Large", "type": "string", "jsonPath": ".spec.large"},
        {"name": "Min-Logprob", "type": "number", "jsonPath": ".spec.minMeanLogprob"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd(
        ROUTE_KIND,
        ROUTE_PLURAL,
        "sroute",
        "A cascade route: a name answered by a small deployment, escalating to a large one.",
        _spec_schema(route_schema(), _ROUTE_TO),
        columns,
    )


def crds() -> list[dict[str, Any]]:
    """Every CustomResourceDefinition Stoker defines: what `stoker crds` prints and the chart ships."""
    return [deployment_crd(), revision_crd(), route_crd()]
