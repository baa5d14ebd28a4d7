"""Who calls the fake API server, and what each may do: the Helm chart rendered into namespace
`stoker` gives the RBAC and the service accounts (controller, node, gateway); each process under
test calls with its account's token, the kubelet and the test harness as `system:admin`.

`DECLARED` is what each component's code says it calls (`API_CALLS`, next to the calls): the chart
must grant exactly that (tests/infra/test_chart.py), and `unexplained` lists what a test's
processes called beyond it, or were refused."""

from __future__ import annotations

import functools

from stoker.control.kube.checkpoints import ConfigMapCheckpointStore
from stoker.control.kube.keys import SecretKeyStore
from stoker.control.kube.registry import ResourceRegistry
from stoker.control.kube.routes import ResourceRoutes
from stoker.control.leader import LeaderElector
from stoker.node.agent import NodeAgent
from tests.conftest import REPO
from tests.kube.fake.apiserver import Call
from tests.kube.fake.rbac import ADMIN, ChartAccess, User, from_chart
from warm_pool.backends.kube import KubeBackend
from warm_pool.backends.kube_access import ApiCall

NAMESPACE = "stoker"
CHART = REPO / "infra" / "helm" / "stoker"
RELEASE = "stoker"
CHART_VALUES = {"adminKey": {"existingSecret": "stoker-admin"}}
ADMIN_TOKEN = "admin-token-0123456789"
TOKENS = {component: f"{component}-token-0123456789" for component in ("controller", "node", "gateway")}
# What each component's processes call, from the code that calls: the controller runs the backend,
# the Lease election, its checkpoints' ConfigMaps and the resources it keeps its state in (deployments,
# tenant keys' Secrets, cascade routes), the node agent labels its Node, the gateways never call the API.
DECLARED: dict[str, frozenset[ApiCall]] = {
    "controller": KubeBackend.API_CALLS
    | LeaderElector.API_CALLS
    | ResourceRegistry.API_CALLS
    | SecretKeyStore.API_CALLS
    | ResourceRoutes.API_CALLS
    | ConfigMapCheckpointStore.API_CALLS,
    "node": NodeAgent.API_CALLS,
    "gateway": frozenset(),
}


@functools.cache
def chart_access(namespace: str = NAMESPACE) -> ChartAccess:
    """The chart's RBAC and service accounts, rendered once per namespace."""
    return from_chart(CHART, CHART_VALUES, release=RELEASE, namespace=namespace)


def tokens(access: ChartAccess) -> dict[str, User]:
    """Each token the fake knows, and whom it authenticates."""
    return {ADMIN_TOKEN: ADMIN, **{TOKENS[c]: user for c, user in access.accounts.items()}}


def asked(call: Call) -> ApiCall:
    a = call.attrs
    return ApiCall(a.group, a.full_resource, a.verb, bool(a.namespace))


def unexplained(made: list[Call], access: ChartAccess) -> list[str]:
    """Each call a component's account made that its code does not declare, or that was refused."""
    components = {user.name: c for c, user in access.accounts.items()}
    found = []
    for call in made:
        component = components.get(call.user)
        if component is None:
            continue
        if asked(call) not in DECLARED[component]:
            found.append(f"{component} made a call its code does not declare: {asked(call)}")
        elif not call.allowed:
            found.append(f"{component} was refused {asked(call)}")
    return found
