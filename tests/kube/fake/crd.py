"""CustomResourceDefinitions as the API server takes them, and the kinds they add.

A CRD (`apiextensions.k8s.io/v1`) is first checked against the official schema like any object
(`schema`), then as apiextensions-apiserver's validation does (`definition_errors`):

    metadata.name is `<spec.names.plural>.<spec.group>`
    exactly one version has `storage: true`; version names are unique
    each served version has `schema.openAPIV3Schema`, and that schema is structural (`openapi`)
    spec.names.kind and listKind, plural, singular: kind starts upper case, the rest lower case

Registered, it is answered with the status a real server reports once its names are taken
(`accepted`: `NamesAccepted` and `Established` True, `acceptedNames`), and each served version is
one `Kind` (`kinds_of`) whose objects are checked by `admit`: pruned, defaulted, validated, in
that order, 422 Invalid in the API server's words
(`Widget.stoker.dev "w" is invalid: spec.gpus: Invalid value: 99: ...`).

Not modelled: names that clash with another CRD's (`NamesAccepted=False`), conversion between
versions (each object is stored and answered in the version it was written in), `shortNames`
and `categories` beyond the schema's checks, the scale subresource, and CEL validation rules.
"""

from __future__ import annotations

import re

from tests.kube.fake import openapi
from tests.kube.fake.kinds import Kind

GROUP = "apiextensions.k8s.io"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class CustomResourceInvalid(ValueError):
    """A custom resource its schema refuses: `message` is the API server's whole 422 message."""


def definition_errors(crd: dict) -> list[str]:
    """Why the API server refuses `crd` beyond its OpenAPI schema; empty if it takes it."""
    spec, name = crd["spec"], crd["metadata"].get("name", "")
    names, errors = spec["names"], []
    if name != f"{names['plural']}.{spec['group']}":
        errors.append(f'metadata.name: Invalid value: "{name}": must be spec.names.plural+"."+spec.group')
    for field in ("plural", "singular", "listKind", "kind"):
        value = names.get(field)
        if value is None:
            continue
        if field in ("plural", "singular") and not DNS_LABEL.match(value):
            errors.append(f'spec.names.{field}: Invalid value: "{value}": a lowercase RFC 1123 label')
        if field in ("kind", "listKind") and not value[:1].isupper():
            errors.append(
                f'spec.names.{field}: Invalid value: "{value}": must start with an upper case letter'
            )
    versions = spec["versions"]
    stored = [v for v in versions if v.get("storage")]
    if len(stored) != 1:
        errors.append(
            f"spec.versions: Invalid value: {len(stored)}: must have exactly one version marked as storage version"
        )
    seen: set[str] = set()
    for i, version in enumerate(versions):
        where = f"spec.versions[{i}]"
        if version["name"] in seen:
            errors.append(f'{where}.name: Duplicate value: "{version["name"]}"')
        seen.add(version["name"])
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            if version.get("served"):
                errors.append(f"{where}.schema.openAPIV3Schema: Required value: schemas are required")
            continue
        errors += openapi.structural_errors(schema, f"{where}.schema.openAPIV3Schema")
    return errors


def accepted(crd: dict, now: str) -> dict:
    """The status a real server writes once it serves the CRD's names."""
    names = dict(crd["spec"]["names"])
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", f"{names['kind']}List")
    conditions = [
        {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
        for kind, reason, message in (
            ("NamesAccepted", "NoConflicts", "no conflicts found"),
            ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        )
    ]
    stored = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
    return {"conditions": conditions, "acceptedNames": names, "storedVersions": stored}


def kinds_of(crd: dict) -> tuple[Kind, ...]:
    """One kind per served version, with its schema and subresources."""
    spec = crd["spec"]
    return tuple(
        Kind(
            spec["names"]["kind"],
            spec["group"],
            spec["names"]["plural"],
            spec["scope"] == "Namespaced",
            None,  # no strategic merge patch for custom resources
            frozenset({"status"}) if "status" in (v.get("subresources") or {}) else frozenset(),
            v["name"],
            openapi=v["schema"]["openAPIV3Schema"],
        )
        for v in spec["versions"]
        if v.get("served")
    )


def admit(obj: dict, kind: Kind) -> dict:
    """`obj` pruned and defaulted as its kind's schema says, or `CustomResourceInvalid`."""
    schema = kind.openapi or {}
    shaped = openapi.default(openapi.prune(obj, schema, root=True), schema)
    assert isinstance(shaped, dict)
    errors = openapi.validation_errors(shaped, schema)
    if errors:
        name = obj.get("metadata", {}).get("name", "")
        listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
        raise CustomResourceInvalid(f'{kind.kind}.{kind.group} "{name}" is invalid: {listed}')
    return shaped
