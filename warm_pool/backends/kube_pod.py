"""What an instance is on Kubernetes: the Pod and the Secret the Kubernetes backend creates, as
plain manifests (dicts in the API's own shape), built by pure functions so tests compare them.

One instance is one Pod named after the instance, running the engine image's `program` with the
spec's arguments, and one Secret `<instance>-key` holding the variables the spec marks secret (the
engine's key): the pod reads them through `secretKeyRef`, so no secret is ever in a pod spec, an
argv or a log. The Secret is owned by the Pod (its ownerReference is set once the pod exists), so
the garbage collector removes it with the pod even when no controller is left to do it.

The snapshot store is the node's own directory (`store_path`, local NVMe), mounted at the same path
in the pod, since the controller builds the engine's argv with that path. An init container pulls
the snapshot into it when the deployment names object storage (a no-op when the node has it).
Scheduling prefers, with weight 100, nodes labelled `snapshots.stoker.dev/<40 hex>` (the node agent
labels each node with what its store holds), so a start loads from local disk where it can.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field

from warm_pool.backends.base import Placement
from warm_pool.engine_tls import MOUNT_DIR
from warm_pool.launch import LaunchSpec

SNAPSHOT_LABEL_PREFIX = "snapshots.stoker.dev/"
MANAGED_BY = ("app.kubernetes.io/managed-by", "stoker")
OWNER_LABEL = "stoker.dev/owner"
DEPLOYMENT_LABEL = "stoker.dev/deployment"
INSTANCE_LABEL = "stoker.dev/instance"
SNAPSHOT_ANNOTATION = "stoker.dev/snapshot"
STARTED_ANNOTATION = "stoker.dev/started-at"  # wall-clock seconds (time.time()), as `Running.started_at`
ENGINE_CONTAINER = "engine"
PULL_CONTAINER = "snapshot-pull"
KEY_ITEM = "key"  # the Secret's item holding the engine's key itself (`Running.secret`)
STORE_VOLUME = "snapshots"
TLS_VOLUME = "engine-tls"  # the engine's TLS Secret, at `warm_pool.engine_tls.MOUNT_DIR`
RUN_AS = 10001  # the images' user (infra/docker): runAsNonRoot needs a numeric uid to check


def snapshot_label(snapshot_id: str) -> str:
    """The node label saying a node's store holds `snapshot_id`: the first 40 hex digits keep the
    name within Kubernetes' 63 characters and are as unique as a git commit id. The node agent sets
    it (value "true"); pods prefer nodes that have it."""
    return SNAPSHOT_LABEL_PREFIX + snapshot_id[:40]


def secret_name(instance_id: str) -> str:
    return f"{instance_id}-key"


def owner_labels(owner: str) -> dict[str, str]:
    """The labels every object of one controller carries: two Stoker installs sharing a namespace
    (different `owner`s) never list, adopt or stop each other's pods."""
    return {MANAGED_BY[0]: MANAGED_BY[1], OWNER_LABEL: owner}


@dataclass(frozen=True)
class PodSettings:
    """The install's side of every pod: what the chart configures, the same for all instances."""

    image: str
    store_path: str  # the snapshot store on every node, and in the pod at the same path
    owner: str
    engine_port: int = 8000
    gpu_resource: str = "nvidia.com/gpu"
    grace_s: int = 30  # terminationGracePeriodSeconds: a deletion without its own grace gets this
    probe_period_s: int = 1  # readiness probe interval: how soon after loading the pool hears "ready"
    image_pull_policy: str = "IfNotPresent"
    pull_env: Mapping[str, str] = field(default_factory=dict)  # the init pull's settings (endpoint URL)
    pull_secret: str | None = None  # a Secret whose items become the init pull's env (S3 credentials)
    tls_secret: str | None = None  # a TLS Secret the engine serves HTTPS with, mounted read-only


def bind_anywhere(args: tuple[str, ...]) -> list[str]:
    """`args` with the engine's bind host (`--host X` / `--host=X`) made 0.0.0.0: in a pod the
    engine must listen on the pod's address, which is known only once it runs."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--host" and i + 1 < len(out):
            out[i + 1] = "0.0.0.0"
        elif arg.startswith("--host="):
            out[i] = "--host=0.0.0.0"
    return out


def secret_manifest(settings: PodSettings, placement: Placement, spec: LaunchSpec) -> dict:
    """The instance's Secret: every secret variable of the spec, and the key itself as `key`."""
    items = {name: spec.env[name] for name in spec.secret_env if name in spec.env}
    items[KEY_ITEM] = placement.secret
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(placement.instance_id),
            "labels": {**owner_labels(settings.owner), INSTANCE_LABEL: placement.instance_id},
        },
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(items.items())},
    }


def owner_reference(pod: Mapping) -> dict:
    """The reference that makes an object the pod's dependent (removed with it)."""
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}


def _env(placement: Placement, spec: LaunchSpec) -> list[dict]:
    env: list[dict] = []
    for name, value in sorted(spec.env.items()):
        if name in spec.secret_env:
            ref = {"name": secret_name(placement.instance_id), "key": name}
            env.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
        else:
            env.append({"name": name, "value": value})
    return env


def _security() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
    }


def _pull_container(settings: PodSettings, uri: str) -> dict:
    """`stoker snapshot pull`: idempotent, so a node that has the snapshot skips the download."""
    container = {
        "name": PULL_CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["stoker"],
        "args": ["snapshot", "pull", uri, "--store", settings.store_path],
        "env": [{"name": k, "value": v} for k, v in sorted(settings.pull_env.items())],
        "volumeMounts": [{"name": STORE_VOLUME, "mountPath": settings.store_path}],
        "securityContext": _security(),
    }
    if settings.pull_secret:
        container["envFrom"] = [{"secretRef": {"name": settings.pull_secret}}]
    return container


def _engine_container(settings: PodSettings, placement: Placement, spec: LaunchSpec) -> dict:
    container = {
        "name": ENGINE_CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": [spec.program],
        "args": bind_anywhere(spec.args),
        "env": _env(placement, spec),
        "ports": [{"name": "http", "containerPort": settings.engine_port, "protocol": "TCP"}],
        "readinessProbe": {
            # the kubelet does not verify an HTTPS probe's certificate; the pool's callers do
            "httpGet": {
                "path": spec.health_path,
                "port": "http",
                "scheme": "HTTPS" if settings.tls_secret else "HTTP",
            },
            "periodSeconds": settings.probe_period_s,
            "timeoutSeconds": 1,
            "failureThreshold": 3,
        },
        "volumeMounts": [{"name": STORE_VOLUME, "mountPath": settings.store_path}],
        "securityContext": _security(),
    }
    if settings.tls_secret:
        container["volumeMounts"].append({"name": TLS_VOLUME, "mountPath": MOUNT_DIR, "readOnly": True})
    if spec.cwd is not None:
        container["workingDir"] = str(spec.cwd)
    resources: dict = {}
    if requests := placement.engine_settings.pod_resources():  # the deployment's `cpu`, `memory`
        resources["requests"] = requests
    if placement.gpus > 0:
        # Extended resources are asked as limits (the request is taken to equal it).
        resources["limits"] = {settings.gpu_resource: str(placement.gpus)}
    if resources:
        container["resources"] = resources
    return container


def pod_manifest(settings: PodSettings, placement: Placement, spec: LaunchSpec, started_at: float) -> dict:
    """The instance's Pod; `started_at` (wall-clock seconds) is recorded for adoption."""
    labels = {
        **owner_labels(settings.owner),
        DEPLOYMENT_LABEL: placement.deployment,
        INSTANCE_LABEL: placement.instance_id,
    }
    prefer_snapshot = {
        "weight": 100,
        "preference": {
            "matchExpressions": [{"key": snapshot_label(placement.snapshot_id), "operator": "Exists"}]
        },
    }
    pod_spec: dict = {
        "restartPolicy": "Never",  # a failed engine is the pool's to replace, with its backoff
        "terminationGracePeriodSeconds": settings.grace_s,
        "automountServiceAccountToken": False,  # the engine never talks to the API
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [prefer_snapshot]}},
        "containers": [_engine_container(settings, placement, spec)],
        "volumes": [{"name": STORE_VOLUME, "hostPath": {"path": settings.store_path, "type": "Directory"}}],
    }
    if settings.tls_secret:
        # tls.crt and tls.key only, readable by the engine's user alone (fsGroup owns them)
        items = [{"key": k, "path": k} for k in ("tls.crt", "tls.key")]
        secret = {"secretName": settings.tls_secret, "items": items, "defaultMode": 0o440}
        pod_spec["volumes"].append({"name": TLS_VOLUME, "secret": secret})
    if placement.snapshot_uri:
        pod_spec["initContainers"] = [_pull_container(settings, placement.snapshot_uri)]
    tolerations = [dict(t) for t in placement.engine_settings.tolerations]
    if placement.gpus > 0:
        # GPU nodes are usually tainted with the resource's name so that other pods keep off them.
        tolerations.insert(0, {"key": settings.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if placement.engine_settings.node_selector:
        pod_spec["nodeSelector"] = dict(placement.engine_settings.node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": placement.instance_id,
            "labels": labels,
            "annotations": {
                SNAPSHOT_ANNOTATION: placement.snapshot_id,
                STARTED_ANNOTATION: f"{started_at:.3f}",
            },
        },
        "spec": pod_spec,
    }


class NodePin:
    """The pin of a snapshot that lives on the nodes: the node agent keeps a node's store, and a pod
    holds its own pin there (the engine pins what it loads), so there is nothing to hold here."""

    def __init__(self, snapshot_id: str, holder: str) -> None:
        self.snapshot_id, self.holder = snapshot_id, holder
        self.held = True

    def release(self) -> None:
        self.held = False


class PodGpus:
    """The GPU inventory of a controller whose instances are pods: each pod asks Kubernetes for its
    GPUs (`nvidia.com/gpu`), and the device plugin shows it those as indices 0..n-1. So an instance
    is handed 0..n-1 here, and the scheduler, not this, decides whether they exist."""

    gpus = (0,)  # "there are GPUs": vLLM's GPU build may be deployed

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}

    def acquire(self, n: int, owner: str) -> list[int]:
        if n < 1:
            raise ValueError(f"acquire needs n >= 1, got {n}")
        self._held[owner] = list(range(n))
        return self._held[owner]

    def held_by(self, owner: str) -> list[int]:
        return self._held.get(owner, [])

    def release(self, owner: str) -> list[int]:
        return self._held.pop(owner, [])
