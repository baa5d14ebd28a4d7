"""The Kubernetes API calls Stoker's processes make, declared next to the code that makes them
(`KubeBackend.API_CALLS`, `LeaderElector.API_CALLS`, `ConfigMapCheckpointStore.API_CALLS`,
`NodeAgent.API_CALLS`), so that what a process may do is read from what it does, in one place:

- the Helm chart grants each process's service account exactly the union of its callers'
  declarations (tests/infra/test_chart.py derives the chart's RBAC rules from them);
- the fake API server of tests/kube records every call each process makes and fails the test
  whose code made one its module does not declare.

A call a module adds without declaring it fails there, naming it; a declaration nothing calls
any more is found by tests/kube/test_rbac.py, which drives every declared call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ApiCall:
    """One kind of request, in RBAC's terms."""

    group: str  # the API group; "" is the core group (pods, secrets, nodes)
    resource: str  # the plural, with its subresource where there is one: "pods/log"
    verb: str  # get, list, watch, create, update (a replace), patch, delete, deletecollection
    namespaced: bool = True  # False: a cluster-scoped resource, granted by a ClusterRole


def calls(group: str, resource: str, *verbs: str, namespaced: bool = True) -> frozenset[ApiCall]:
    return frozenset(ApiCall(group, resource, verb, namespaced) for verb in verbs)
