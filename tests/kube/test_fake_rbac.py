"""The fake's RBAC: which bindings give which rules where (a table), the API server's 403 wording,
and each HTTP request resolved to the verb Kubernetes names it."""

from __future__ import annotations

import httpx
import pytest

from tests.kube.accounts import ADMIN_TOKEN, TOKENS
from tests.kube.conftest import NAMESPACE, Cluster_
from tests.kube.fake.rbac import ADMIN, Attributes, Policy, User, forbidden_message, service_account

SA = service_account("ns", "sa")


def role(kind: str, name: str, *rules: dict, namespace: str = "ns") -> dict:
    meta = {"name": name, **({"namespace": namespace} if kind == "Role" else {})}
    return {"kind": kind, "metadata": meta, "rules": list(rules)}


def binding(kind: str, role_kind: str, role_name: str, *subjects: dict, namespace: str = "ns") -> dict:
    meta = {"name": f"{role_name}-binding", **({"namespace": namespace} if kind == "RoleBinding" else {})}
    return {
        "kind": kind,
        "metadata": meta,
        "roleRef": {"kind": role_kind, "name": role_name},
        "subjects": list(subjects),
    }


def rule(
    resources: list[str], verbs: list[str], groups: tuple[str, ...] = ("",), names: tuple[str, ...] = ()
) -> dict:
    out = {"apiGroups": list(groups), "resources": resources, "verbs": verbs}
    return {**out, "resourceNames": list(names)} if names else out


SA_SUBJECT = {"kind": "ServiceAccount", "name": "sa", "namespace": "ns"}
PODS = rule(["pods"], ["get", "list"])
POLICIES = {
    "a Role, in its namespace": (
        [role("Role", "r", PODS), binding("RoleBinding", "Role", "r", SA_SUBJECT)],
        [(Attributes("get", "", "pods", namespace="ns", name="p"), True),
         (Attributes("get", "", "pods", namespace="other", name="p"), False),
         (Attributes("delete", "", "pods", namespace="ns", name="p"), False),
         (Attributes("get", "", "pods", "log", namespace="ns", name="p"), False),  # a subresource is its own
         (Attributes("get", "apps", "pods", namespace="ns", name="p"), False)],
    ),
    "a ClusterRole bound in a namespace": (
        [role("ClusterRole", "c", PODS), binding("RoleBinding", "ClusterRole", "c", SA_SUBJECT)],
        [(Attributes("list", "", "pods", namespace="ns"), True),
         (Attributes("list", "", "pods", namespace="other"), False),
         (Attributes("list", "", "pods"), False)],  # every namespace at once is cluster scope
    ),
    "a ClusterRoleBinding, everywhere": (
        [role("ClusterRole", "c", rule(["nodes", "pods"], ["get"])),
         binding("ClusterRoleBinding", "ClusterRole", "c", SA_SUBJECT)],
        [(Attributes("get", "", "nodes", name="n"), True),
         (Attributes("get", "", "pods", namespace="other", name="p"), True)],
    ),
    "subresources, wildcards and names": (
        [role("Role", "r", rule(["*/log"], ["get"]), rule(["secrets"], ["*"], names=("mine",)),
              rule(["leases"], ["update"], groups=("*",))),
         binding("RoleBinding", "Role", "r", SA_SUBJECT)],
        [(Attributes("get", "", "pods", "log", namespace="ns", name="p"), True),
         (Attributes("get", "", "pods", namespace="ns", name="p"), False),
         (Attributes("delete", "", "secrets", namespace="ns", name="mine"), True),
         (Attributes("delete", "", "secrets", namespace="ns", name="theirs"), False),
         (Attributes("create", "", "secrets", namespace="ns"), False),  # a create has no name yet
         (Attributes("update", "coordination.k8s.io", "leases", namespace="ns", name="l"), True)],
    ),
    "groups and users as subjects": (
        [role("Role", "r", PODS),
         binding("RoleBinding", "Role", "r", {"kind": "Group", "name": "system:serviceaccounts:ns"})],
        [(Attributes("get", "", "pods", namespace="ns", name="p"), True)],
    ),
    "a binding to a role that does not exist grants nothing": (
        [binding("RoleBinding", "Role", "missing", SA_SUBJECT)],
        [(Attributes("get", "", "pods", namespace="ns", name="p"), False)],
    ),
    "another account's binding": (
        [role("Role", "r", PODS),
         binding("RoleBinding", "Role", "r", {"kind": "ServiceAccount", "name": "other", "namespace": "ns"})],
        [(Attributes("get", "", "pods", namespace="ns", name="p"), False)],
    ),
}  # fmt: skip


@pytest.mark.parametrize(("objects", "cases"), POLICIES.values(), ids=POLICIES.keys())
def test_policy(objects: list[dict], cases: list[tuple[Attributes, bool]]) -> None:
    policy = Policy.from_objects(objects)
    for attrs, allowed in cases:
        assert policy.allows(SA, attrs) is allowed, attrs
    assert all(policy.allows(ADMIN, attrs) for attrs, _ in cases)  # system:masters may do anything
    assert not any(Policy().allows(SA, attrs) for attrs, _ in cases)  # no policy grants nothing
    assert not any(policy.allows(User("someone"), attrs) for attrs, _ in cases)


MESSAGES = {
    "named, in a namespace": (
        Attributes("patch", "", "pods", namespace="ns", name="x"),
        'pods "x" is forbidden: User "system:serviceaccount:ns:sa" cannot patch resource "pods" in API group ""'
        ' in the namespace "ns"',
    ),
    "a collection": (
        Attributes("list", "", "secrets", namespace="ns"),
        'secrets is forbidden: User "system:serviceaccount:ns:sa" cannot list resource "secrets" in API group ""'
        ' in the namespace "ns"',
    ),
    "a subresource": (
        Attributes("get", "", "pods", "log", namespace="ns", name="x"),
        'pods "x" is forbidden: User "system:serviceaccount:ns:sa" cannot get resource "pods/log" in API group ""'
        ' in the namespace "ns"',
    ),
    "the cluster scope, another group": (
        Attributes("delete", "rbac.authorization.k8s.io", "clusterroles", name="c"),
        'clusterroles.rbac.authorization.k8s.io "c" is forbidden: User "system:serviceaccount:ns:sa" cannot '
        'delete resource "clusterroles" in API group "rbac.authorization.k8s.io" at the cluster scope',
    ),
}


@pytest.mark.parametrize(("attrs", "message"), MESSAGES.values(), ids=MESSAGES.keys())
def test_the_forbidden_message_is_the_api_servers(attrs: Attributes, message: str) -> None:
    assert forbidden_message(SA, attrs) == message


async def test_each_request_is_authorized_by_the_verb_kubernetes_names_it(cluster: Cluster_) -> None:
    cluster.probing = True
    base = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    merge = {"content-type": "application/merge-patch+json"}
    requests = [
        ("POST", base, {"json": secret}, "create", ""),
        ("GET", f"{base}/s", {}, "get", ""),
        ("GET", base, {}, "list", ""),
        ("GET", base, {"params": {"watch": "true", "timeoutSeconds": "0"}}, "watch", ""),
        ("PUT", f"{base}/s", {"json": secret}, "update", ""),
        ("PATCH", f"{base}/s", {"json": {"metadata": {"labels": {"a": "b"}}}, "headers": merge}, "patch", ""),
        ("DELETE", f"{base}/s", {}, "delete", ""),
        ("DELETE", base, {}, "deletecollection", ""),
        ("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/p/log", {}, "get", "log"),
        (
            "PATCH",
            f"/api/v1/namespaces/{NAMESPACE}/pods/p/status",
            {"json": {}, "headers": merge},
            "patch",
            "status",
        ),
    ]
    async with httpx.AsyncClient(base_url=cluster.api.url) as http:
        for method, path, kwargs, verb, sub in requests:
            resource = f"pods/{sub}" if sub else "secrets"
            extra = kwargs.pop("headers", {})
            for token, allowed in ((TOKENS["gateway"], False), (ADMIN_TOKEN, True)):
                before = len(cluster.api.calls)
                headers = {"Authorization": f"Bearer {token}", **extra}
                answer = await http.request(method, path, headers=headers, **kwargs)
                # this request's call (the kubelet calls too, on pods, never on a subresource of this test)
                [call] = [c for c in cluster.api.calls[before:] if c.attrs.full_resource == resource]
                assert (call.attrs.verb, call.attrs.subresource, call.allowed) == (verb, sub, allowed), (
                    method,
                    path,
                )
                if not allowed:
                    assert answer.status_code == 403, answer.text
