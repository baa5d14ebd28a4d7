"""Who may do what on the fake API server: users by bearer token, and RBAC as the API server's
authorizer applies it, from Role, ClusterRole, RoleBinding and ClusterRoleBinding objects (in the
tests: the ones the Helm chart renders, `from_chart`).

A request is resolved into `Attributes` as the API server's RequestInfo resolver does (verb
`get`, `list`, `watch`, `create`, `update`, `patch`, `delete` or `deletecollection`; API group;
resource and subresource, `pods/log`; namespace; name), and allowed when some rule bound to the
user matches all of them:

    RoleBinding(Role or ClusterRole)  its rules, in the binding's namespace only
    ClusterRoleBinding(ClusterRole)   its rules, in every namespace and at the cluster scope
    a rule                            verb in verbs, group in apiGroups, resource (or
                                      "resource/subresource") in resources, "*" matching any; with
                                      resourceNames, only those names (so never a create)

Members of `system:masters` are allowed everything, as on a cluster (the fake kubelet and the test
harness call as `ADMIN`). Anything else is refused with the API server's 403: `pods "x" is
forbidden: User "system:serviceaccount:ns:sa" cannot patch resource "pods" in API group "" in
the namespace "ns"`. Not modelled: aggregated ClusterRoles (`aggregationRule`), non-resource
URLs, the Node authorizer, impersonation, and escalation checks on writes of RBAC objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.infra.helmlite import manifests, render_chart

AUTHENTICATED = "system:authenticated"
MASTERS = "system:masters"
RBAC_KINDS = frozenset({"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"})


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = (AUTHENTICATED,)


ADMIN = User("system:admin", (MASTERS, AUTHENTICATED))


def service_account(namespace: str, name: str) -> User:
    """The user a service account's token authenticates as, with the groups it is in."""
    groups = ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED)
    return User(f"system:serviceaccount:{namespace}:{name}", groups)


@dataclass(frozen=True)
class Attributes:
    """What one request asks to do."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""  # "" at the cluster scope
    name: str = ""  # "" for a collection, and for a create

    @property
    def full_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def forbidden_message(user: User, attrs: Attributes) -> str:
    """The API server's words (apiserver's responsewriters.forbiddenMessage, then NewForbidden)."""
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    why = (
        f'User "{user.name}" cannot {attrs.verb} resource "{attrs.full_resource}" '
        f'in API group "{attrs.group}" {where}'
    )
    resource = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    named = f'{resource} "{attrs.name}"' if attrs.name else resource
    return f"{named} is forbidden: {why}"


@dataclass(frozen=True)
class Rule:
    api_groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    resource_names: frozenset[str] = frozenset()

    @classmethod
    def from_dict(cls, rule: dict) -> Rule:
        if rule.get("nonResourceURLs"):
            raise ValueError("the fake does not model nonResourceURLs rules")
        return cls(
            frozenset(rule.get("apiGroups") or ()),
            frozenset(rule.get("resources") or ()),
            frozenset(rule.get("verbs") or ()),
            frozenset(rule.get("resourceNames") or ()),
        )

    def matches(self, attrs: Attributes) -> bool:
        resources = {attrs.full_resource, "*"}
        if attrs.subresource:
            resources.add(f"*/{attrs.subresource}")
        return (
            bool({attrs.verb, "*"} & self.verbs)
            and bool({attrs.group, "*"} & self.api_groups)
            and bool(resources & self.resources)
            and (not self.resource_names or attrs.name in self.resource_names)
        )


@dataclass(frozen=True)
class Grant:
    """One binding: its role's rules, given to its subjects in a namespace (None: everywhere)."""

    namespace: str | None
    subjects: tuple[tuple[str, str, str], ...]  # (kind, name, namespace)
    rules: tuple[Rule, ...]

    def covers(self, user: User) -> bool:
        for kind, name, namespace in self.subjects:
            if kind == "ServiceAccount" and user.name == f"system:serviceaccount:{namespace}:{name}":
                return True
            if (kind == "User" and user.name == name) or (kind == "Group" and name in user.groups):
                return True
        return False


class Policy:
    """The cluster's RBAC: every binding, each with its role's rules resolved."""

    def __init__(self, grants: Iterable[Grant] = ()) -> None:
        self.grants = tuple(grants)

    @classmethod
    def from_objects(cls, objects: Iterable[dict]) -> Policy:
        objects = [o for o in objects if o.get("kind") in RBAC_KINDS]
        roles = {
            (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): tuple(
                Rule.from_dict(r) for r in o.get("rules") or []
            )
            for o in objects
            if o["kind"] in ("Role", "ClusterRole")
        }
        grants = []
        for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
            ref, meta = binding["roleRef"], binding["metadata"]
            namespace = meta.get("namespace", "") if binding["kind"] == "RoleBinding" else None
            if ref["kind"] == "Role" and namespace is None:
                raise ValueError(f"ClusterRoleBinding {meta['name']} refers to a Role")
            role_namespace = namespace if ref["kind"] == "Role" else ""
            rules = roles.get((ref["kind"], role_namespace, ref["name"]), ())  # none there: grants nothing
            subjects = tuple(
                (s["kind"], s["name"], s.get("namespace", namespace or ""))
                for s in binding.get("subjects") or []
            )
            grants.append(Grant(namespace, subjects, rules))
        return cls(grants)

    def allows(self, user: User, attrs: Attributes) -> bool:
        if MASTERS in user.groups:
            return True
        return any(
            (grant.namespace is None or grant.namespace == attrs.namespace)
            and grant.covers(user)
            and any(rule.matches(attrs) for rule in grant.rules)
            for grant in self.grants
        )


@dataclass(frozen=True)
class ChartAccess:
    """What a rendered chart grants: its policy, and the user each component's account is."""

    policy: Policy
    accounts: dict[str, User]  # by app.kubernetes.io/component: controller, node, gateway
    objects: tuple[dict, ...]


def from_chart(chart: Path, values: dict, *, release: str, namespace: str) -> ChartAccess:
    """The chart rendered (helmlite, as tests/infra/test_chart.py does) into `namespace`. Objects
    without a namespace are given the release's, as `helm install -n` does for namespaced kinds."""
    objects = manifests(render_chart(chart, values, release=release, namespace=namespace))
    return access_of(objects, namespace)


def access_of(objects: Iterable[dict], namespace: str) -> ChartAccess:
    placed = []
    for obj in objects:
        if obj["kind"] in ("Role", "RoleBinding", "ServiceAccount"):
            obj = {**obj, "metadata": {"namespace": namespace, **obj["metadata"]}}
        placed.append(obj)
    accounts = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: service_account(
            namespace, o["metadata"]["name"]
        )
        for o in placed
        if o["kind"] == "ServiceAccount"
    }
    return ChartAccess(Policy.from_objects(placed), accounts, tuple(placed))
