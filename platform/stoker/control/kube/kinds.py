"""Stoker's custom resources as lightkube classes (`stoker.spec.resources` defines them), and the
labels and finalizer the controller puts on what it writes."""

from __future__ import annotations

from lightkube.generic_resource import create_namespaced_resource

from stoker.spec.resources import (
    GROUP,
    KIND,
    PLURAL,
    REVISION_KIND,
    REVISION_PLURAL,
    ROUTE_KIND,
    ROUTE_PLURAL,
    VERSION,
)

StokerDeployment = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)
StokerRevision = create_namespaced_resource(GROUP, VERSION, REVISION_KIND, REVISION_PLURAL)
StokerRoute = create_namespaced_resource(GROUP, VERSION, ROUTE_KIND, ROUTE_PLURAL)

API_VERSION = f"{GROUP}/{VERSION}"
# Kept on each StokerDeployment until its instances have drained: `kubectl delete` waits for that.
FINALIZER = "stoker.dev/drain"
DEPLOYMENT_LABEL = "stoker.dev/deployment"  # on each StokerRevision: whose it is
REVISION_LABEL = "stoker.dev/revision"
MANAGED = {"app.kubernetes.io/managed-by": "stoker"}
