"""The kinds the fake API server serves, as a table: each with its group, version and plural (which
name its paths), its scope, its subresources, and the OpenAPI type strategic merge patch reads its
lists' merge keys from. A custom resource is an entry with no such type (the API server refuses
strategic merge patch for those, and so does the fake) and with its CRD version's
`openAPIV3Schema` instead: `crd.kinds_of` makes those entries when a CRD is registered."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kind:
    kind: str
    group: str
    plural: str
    namespaced: bool
    schema: str | None  # its OpenAPI type (strategic merge patch reads it); None: a custom resource
    subresources: frozenset[str] = frozenset()
    version: str = "v1"
    openapi: dict | None = field(default=None, compare=False)  # a custom resource's schema

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> str:
        """The group-qualified resource (`pods`, `leases.coordination.k8s.io`): the store's key."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


KINDS = (
    Kind("Pod", "", "pods", True, "io.k8s.api.core.v1.Pod", frozenset({"status", "log"})),
    Kind("Secret", "", "secrets", True, "io.k8s.api.core.v1.Secret"),
    Kind("ConfigMap", "", "configmaps", True, "io.k8s.api.core.v1.ConfigMap"),
    Kind("Node", "", "nodes", False, "io.k8s.api.core.v1.Node", frozenset({"status"})),
    Kind("Namespace", "", "namespaces", False, "io.k8s.api.core.v1.Namespace", frozenset({"status"})),
    Kind("Lease", "coordination.k8s.io", "leases", True, "io.k8s.api.coordination.v1.Lease"),
    Kind(
        "CustomResourceDefinition",
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        False,
        "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.v1.CustomResourceDefinition",
        frozenset({"status"}),
    ),
)
NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})
