"""The Kubernetes backend: each engine instance is a pod (`warm_pool.backends.kube_pod` builds it).

Pods are seen through one list-and-watch of this controller's own pods (labels
`app.kubernetes.io/managed-by=stoker, stoker.dev/owner=<owner>`), kept in memory: `is_alive` is a
dict lookup, `wait_ready` and `stop` wait on changes to it. The watch resumes from the last
resourceVersion it saw; a 410 Gone (the version was compacted away) or a broken connection
starts over with a fresh list, so no change is missed for long.

A pod's lifecycle as the pool sees it:

    start      create the Secret, then the Pod, then make the Pod the Secret's owner (GC)
    wait_ready the pod's Ready condition (the kubelet's readiness probe on the health path)
               → http(s)://<podIP>:<port>; StartFailed if it fails, is deleted, or time runs out,
               with the reason from its status (Unschedulable, ErrImagePull, an exit code)
    stop       delete with the grace period; wait until it is gone; the engine's exit code
    running    this owner's Running pods and their Secrets: a restarted controller adopts them

Before any of it, `check_admission` asks the API server (a server-side dry run) whether the
namespace admits a pod shaped as every engine pod: each mounts the node's snapshot store, a
hostPath, which Pod Security admits only at the `privileged` level.

Handles carry the pod's uid, so a later pod that got the same name is never mistaken for it.
Secrets are read only to adopt (the key) and never logged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx2
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.models.meta_v1 import OwnerReference
from lightkube.resources.core_v1 import Node, Pod, Secret
from lightkube.types import PatchType

from warm_pool.backends.base import Placement, Running
from warm_pool.backends.kube_access import calls
from warm_pool.backends.kube_pod import (
    DEPLOYMENT_LABEL,
    ENGINE_CONTAINER,
    KEY_ITEM,
    OWNER_LABEL,
    PULL_CONTAINER,
    SNAPSHOT_ANNOTATION,
    STARTED_ANNOTATION,
    NodePin,
    PodGpus,
    PodSettings,
    owner_labels,
    owner_reference,
    pod_manifest,
    secret_manifest,
    secret_name,
    snapshot_label,
)
from warm_pool.backends.kube_status import alive, held_up, is_ready, pending_reason, terminated, waiting
from warm_pool.backends.kube_watch import PodWatch
from warm_pool.engine_tls import EngineTls, scheme
from warm_pool.errors import InvalidConfig, PoolError, StartFailed
from warm_pool.launch import LaunchSpec
from warm_pool.log_text import FAILURE_LOG_LINES, meaningful_lines
from warm_pool.policies.base import Tier
from warm_pool.snapshot import Acquired, SnapshotSource

__all__ = ["KubeBackend", "NodePin", "PodGpus", "PodHandle", "snapshot_label"]

log = logging.getLogger(__name__)

# How long past its grace a deleted pod may take to go: the kubelet's next sync (up to ~10 s on a
# busy node) plus its status update. Longer, and the node is taken as lost.
_KUBELET_SLACK_S = 30.0
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)$")
# Waiting reasons that no amount of waiting fixes: the start fails at once with the reason.
_FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
}


_ADMISSION_CHECK = "stoker-admission-check"  # the dry-run pod's name: never stored


def _refused(namespace: str, message: str) -> str:
    """Why engine pods cannot run in `namespace`, from the API server's refusal; what to do about it
    where it was Pod Security (any other refusal, RBAC's or a policy webhook's, says its own)."""
    why = f"namespace {namespace} does not admit Stoker's engine pods: {message}"
    if "violates PodSecurity" not in message:
        return why
    return (
        f"{why}. Every engine pod mounts the node's snapshot store, a hostPath volume, which only the "
        "privileged Pod Security level admits: label the namespace pod-security.kubernetes.io/enforce="
        f"privileged (kubectl label namespace {namespace} pod-security.kubernetes.io/enforce=privileged "
        "--overwrite)"
    )


@dataclass(frozen=True)
class PodHandle:
    namespace: str
    pod: str
    uid: str

    @property
    def name(self) -> str:
        return f"pod {self.namespace}/{self.pod}"


class KubeBackend:
    """Engines as pods in `namespace`. `client_or_config`: a lightkube AsyncClient (shared, not
    closed here) or a KubeConfig (a client of its own, closed by `aclose`). `owner` names this
    controller (a label value: letters, digits, `-_.`, at most 63): its pods carry it, and only its
    pods are watched, adopted and stopped. Call `aclose()` when done."""

    kind = "kubernetes"
    # Every call this backend (and its PodWatch) makes; the chart grants exactly these.
    API_CALLS = (
        calls("", "pods", "create", "list", "watch", "delete")  # start (and its dry run), the watch, stop
        | calls("", "pods/log", "get")  # the failure's log, vLLM's start phases
        | calls("", "secrets", "create", "update", "patch", "get", "delete")  # update: replace a left one;
        #                                          patch: the pod as its owner; get: adopt the key
        | calls("", "nodes", "list", namespaced=False)  # which node's store holds a snapshot
    )

    def __init__(
        self,
        client_or_config: AsyncClient | KubeConfig,
        namespace: str,
        *,
        image: str,
        store_path: str | Path,
        owner: str,
        engine_port: int = 8000,
        gpu_resource: str = "nvidia.com/gpu",
        grace_s: int = 30,
        probe_period_s: int = 1,
        pull_env: Mapping[str, str] | None = None,
        pull_secret: str | None = None,
        watch_retry_s: float = 1.0,
        sync_timeout_s: float = 30.0,
        wall_clock: Callable[[], float] = time.time,
        engine_tls: EngineTls | None = None,  # engine pods mount its Secret and serve HTTPS with it
    ) -> None:
        if not _LABEL_VALUE.match(owner):
            raise InvalidConfig(
                "owner", f"owner must be a Kubernetes label value (63 chars of [A-Za-z0-9._-]), got {owner!r}"
            )
        if not 1 <= engine_port <= 65535:
            raise InvalidConfig("engine_port", f"engine_port must be within 1-65535, got {engine_port}")
        self._own_client = isinstance(client_or_config, KubeConfig)
        self._client = (
            AsyncClient(config=client_or_config, namespace=namespace)
            if self._own_client
            else client_or_config
        )
        self.namespace = namespace
        self.settings = PodSettings(
            image=image,
            store_path=str(store_path),
            owner=owner,
            engine_port=engine_port,
            gpu_resource=gpu_resource,
            grace_s=grace_s,
            probe_period_s=probe_period_s,
            pull_env=dict(pull_env or {}),
            pull_secret=pull_secret,
            tls_secret=engine_tls.secret if engine_tls is not None else None,
        )
        self.engine_tls = engine_tls
        self._labels = owner_labels(owner)
        self._wall_clock = wall_clock
        # This owner's pods as last seen; a pod that ends has its log read while it is still there.
        self._watch = PodWatch(
            self._client,
            namespace,
            self._labels,
            retry_s=watch_retry_s,
            sync_timeout_s=sync_timeout_s,
            on_ended=self._refresh_log,
        )
        self._logs: dict[str, list[str]] = {}  # by instance id: the last log tail read
        self._log_reads: dict[str, asyncio.Task] = {}

    # -- the protocol -------------------------------------------------------------------------------

    def engine_port(self, host: str) -> int:
        """Every pod has its own address, so every engine listens on the same port."""
        return self.settings.engine_port

    async def acquire(self, snapshot: SnapshotSource, holder: str) -> Acquired:
        """No local pull: the pod's node has the snapshot or its init container pulls it. The tier is
        local disk if some node's store holds it (its label says so), else object storage."""
        path = Path(self.settings.store_path) / snapshot.snapshot_id
        tier = Tier.DISK if await self._some_node_holds(snapshot.snapshot_id) else Tier.OBJECT_STORAGE
        return Acquired(path=path, pin=NodePin(snapshot.snapshot_id, holder), tier=tier, pulled=None)  # type: ignore[arg-type]

    async def start(self, placement: Placement, spec: LaunchSpec) -> PodHandle:
        """Create the Secret, then the Pod; then hand the Secret to the Pod for garbage collection.
        A Secret left from an earlier failed attempt with this name is replaced."""
        await self._watch.ensure()
        await self._create_secret(Secret.from_dict(secret_manifest(self.settings, placement, spec)))
        manifest = pod_manifest(self.settings, placement, spec, self._wall_clock())
        try:
            pod = await self._client.create(Pod.from_dict(manifest), namespace=self.namespace)
        except (ApiError, httpx2.HTTPError) as exc:
            await self._delete_secret(placement.instance_id)
            why = exc.status.message if isinstance(exc, ApiError) else f"{type(exc).__name__}: {exc}"
            raise StartFailed(
                f"pod {self.namespace}/{placement.instance_id} was not created: {why}", phase="process_start"
            ) from None
        current = self._watch.pods.get(pod.metadata.name)
        if current is None or current.metadata.uid != pod.metadata.uid:
            self._watch.remember(pod)  # unless the watch was quicker, and has a newer state already
        await self._own_secret(pod)
        return PodHandle(self.namespace, pod.metadata.name, pod.metadata.uid)

    def is_alive(self, handle: PodHandle) -> bool:
        pod = self._watch.pods.get(handle.pod)
        return pod is not None and pod.metadata.uid == handle.uid and alive(pod)

    async def wait_ready(self, handle: PodHandle, timeout_s: float, *, health_path: str = "/health") -> str:
        """The pod's URL once Ready: its readiness probe is an httpGet on the spec's `health_path`
        (the one given here is the same, from the same spec). StartFailed, with the reason and the
        log's tail, if it fails, is deleted, or is not Ready within `timeout_s`."""
        await self._watch.ensure()
        outcome: list[str | StartFailed] = []

        def decided() -> bool:
            result = self._ready_or_failed(handle)
            if result is not None:
                outcome.append(result)
            return result is not None

        if not await self._watch.wait_for(decided, timeout_s):
            pod = self._watch.pods.get(handle.pod)
            why = pending_reason(pod) if pod is not None else "no such pod"
            raise await self._failed(handle, f"not ready after {timeout_s:g}s ({why})", None, "wait_ready")
        result = outcome[0]
        if isinstance(result, StartFailed):
            raise await self._with_log(handle, result)
        return result

    async def stop(self, handle: PodHandle, term_timeout_s: float) -> int | None:
        """Delete the pod with `term_timeout_s` of grace and wait until it is gone (the kubelet stops
        it: SIGTERM, SIGKILL at the end of the grace); then its Secret. The engine's exit code where
        the pod reported it. A pod still there well after its grace (its node is lost) is deleted by
        force, as `kubectl delete --force` does. Safe to repeat, and on the already gone."""
        await self._watch.ensure()
        grace = max(0, math.ceil(term_timeout_s))
        current = self._watch.pods.get(handle.pod)
        if current is not None and current.metadata.uid != handle.uid:
            return None  # a later pod with the same name: not ours to stop, nor its Secret
        if current is not None:
            await self._delete_pod(handle.pod, grace)
            gone = await self._watch.wait_for(lambda: self._watch.gone_now(handle), grace + _KUBELET_SLACK_S)
            if not gone:
                log.warning(
                    "%s still there %gs after its grace: deleting by force", handle.name, _KUBELET_SLACK_S
                )
                await self._delete_pod(handle.pod, 0)
                await self._watch.wait_for(lambda: self._watch.gone_now(handle), 10.0)
        await self._delete_secret(handle.pod)
        last = self._watch.gone.pop(handle.uid, None) or current
        self._logs.pop(handle.pod, None)
        return self._exit_code(last) if last is not None else None

    async def running(self) -> list[Running]:
        """This owner's Running pods (not being deleted), each with its Secret's key: what a previous
        controller left. The rest of this owner's pods (still Pending, ended, or without a whole
        record: labels, annotations, Secret) cannot be taken over, and are deleted."""
        await self._watch.ensure()
        found: list[Running] = []
        for pod in list(self._watch.pods.values()):
            adopted = None
            if alive(pod) and pod.status.phase == "Running" and pod.status.podIP:
                adopted = await self._adoptable(pod)
            if adopted is not None:
                found.append(adopted)
            elif pod.metadata.deletionTimestamp is None:
                phase = pod.status.phase if pod.status is not None else "unknown"
                log.warning(
                    "pod %s left by a previous controller (%s) cannot be adopted: deleting it",
                    pod.metadata.name,
                    phase,
                )
                await self._delete_pod(pod.metadata.name, self.settings.grace_s)
        return found

    async def read_log(self, instance_id: str, max_bytes: int) -> str | None:
        """The end of the engine container's log (vLLM's start phases are read from it)."""
        text = await self._log_text(instance_id, ENGINE_CONTAINER, tail_lines=5000)
        return None if text is None else text[-max_bytes:]

    def _refresh_log(self, instance_id: str) -> None:
        """Read the pod's log in the background, unless a read is under way or there is no pod."""
        if instance_id in self._watch.pods and instance_id not in self._log_reads:
            with contextlib.suppress(RuntimeError):  # no running loop: the cached lines only
                task = asyncio.get_running_loop().create_task(self._read_log(instance_id, ENGINE_CONTAINER))
                self._log_reads[instance_id] = task
                task.add_done_callback(lambda _: self._log_reads.pop(instance_id, None))

    async def aclose(self) -> None:
        """Stop watching; close the client if this backend made it. Pods are left running."""
        await self._watch.close()
        for task in list(self._log_reads.values()):
            task.cancel()
        if self._own_client:
            await self._client.close()

    async def check_admission(self) -> None:
        """InvalidConfig if the namespace refuses engine pods: a pod shaped as every engine pod is
        (its hostPath store, its security contexts, an init pull) is created as a server-side dry
        run, so the API server's own admission answers, Pod Security included, with whatever
        labels, defaults and exemptions the cluster has. That is the one honest test: a label read
        here could not see the cluster's defaults. An API that cannot be asked is only logged:
        each start says why it fails anyway."""
        placement = Placement(
            _ADMISSION_CHECK, "admission-check", "0" * 64, "s3://admission-check/x", "cpu", 0, "0.0.0.0",
            self.settings.engine_port, "",
        )  # fmt: skip
        spec = LaunchSpec(("stoker", "engine"), program="stoker")
        manifest = pod_manifest(self.settings, placement, spec, self._wall_clock())
        try:
            await self._client.create(Pod.from_dict(manifest), namespace=self.namespace, dry_run=True)
        except ApiError as exc:
            if exc.status.code == 403:
                raise InvalidConfig("namespace", _refused(self.namespace, exc.status.message)) from None
            log.warning(
                "checking that namespace %s admits engine pods: %s", self.namespace, exc.status.message
            )
        except httpx2.HTTPError as exc:
            log.warning("checking that namespace %s admits engine pods: %s", self.namespace, exc)

    # -- readiness and failure ----------------------------------------------------------------------

    def _ready_or_failed(self, handle: PodHandle) -> str | StartFailed | None:
        """The URL if Ready, a StartFailed if it cannot become so, None while it may yet."""
        pod = self._watch.pods.get(handle.pod)
        if pod is None or pod.metadata.uid != handle.uid:
            return StartFailed(f"{handle.name} was deleted before it was ready", phase="process_start")
        if pod.metadata.deletionTimestamp is not None:
            return StartFailed(f"{handle.name} is being deleted", phase="process_start")
        if is_ready(pod) and alive(pod):
            return f"{scheme(self.engine_tls)}://{pod.status.podIP}:{self.settings.engine_port}"
        if (ended := terminated(pod)) is not None and not alive(pod):
            container, state = ended
            what = f"container {container} exited with status {state.exitCode}"
            detail = "; ".join(filter(None, (state.reason, state.message)))
            phase = "snapshot" if container == PULL_CONTAINER else "process_start"
            return StartFailed(
                f"{handle.name}: {what} ({detail}) before it was ready", exit_code=state.exitCode, phase=phase
            )
        if not alive(pod):
            return StartFailed(
                f"{handle.name} ended ({pending_reason(pod)}) before it was ready", phase="process_start"
            )
        if (stuck := waiting(pod)) is not None and stuck[0] in _FATAL_WAITING:
            return StartFailed(f"{handle.name}: {': '.join(filter(None, stuck))}", phase="process_start")
        return None

    async def _failed(self, handle: PodHandle, what: str, code: int | None, phase: str) -> StartFailed:
        return await self._with_log(handle, StartFailed(f"{handle.name} {what}", exit_code=code, phase=phase))

    async def _with_log(self, handle: PodHandle, failure: StartFailed) -> StartFailed:
        """`failure` with the tail of the log of the container that failed."""
        pod = self._watch.pods.get(handle.pod) or self._watch.gone.get(handle.uid)
        ended = terminated(pod) if pod is not None else None
        container = ended[0] if ended is not None else ENGINE_CONTAINER
        lines = await self._read_log(handle.pod, container)
        if not lines:
            return failure
        tail = " | ".join(lines[-5:])
        return StartFailed(
            f"{failure}; log: {tail}",
            exit_code=failure.exit_code,
            log_tail=tail,
            phase=failure.phase,
            log_lines=tuple(lines),
        )

    async def tail_log(self, instance_id: str, lines: int) -> str | None:
        """The last `lines` lines of the instance's engine container (`stoker logs`); None if the
        API has none to give (no such pod any more, no log yet)."""
        return await self._log_text(instance_id, ENGINE_CONTAINER, tail_lines=lines)

    async def _log_text(self, pod: str, container: str, tail_lines: int) -> str | None:
        try:
            chunks = [
                c
                async for c in self._client.log(
                    pod, namespace=self.namespace, container=container, tail_lines=tail_lines
                )
            ]
        except (ApiError, httpx2.HTTPError) as exc:
            log.debug("log of pod %s: %s", pod, exc)
            return None
        return "".join(chunks)

    async def _read_log(self, pod: str, container: str) -> list[str]:
        """The last lines of a container's log; [] if it cannot be read (no pod, no log yet)."""
        text = await self._log_text(pod, container, tail_lines=200)
        if text is None:
            return self._logs.get(pod, [])
        lines = meaningful_lines(text, FAILURE_LOG_LINES)
        if container == ENGINE_CONTAINER:
            self._logs[pod] = lines
        return lines

    @staticmethod
    def _exit_code(pod: Pod) -> int | None:
        for cs in (pod.status and pod.status.containerStatuses) or []:
            if cs.name == ENGINE_CONTAINER and cs.state is not None and cs.state.terminated is not None:
                return cs.state.terminated.exitCode
        return None

    # -- API calls ----------------------------------------------------------------------------------

    async def _create_secret(self, secret: Secret) -> None:
        """Create it; one left by an earlier attempt under this name is replaced."""
        name = secret.metadata.name
        try:
            try:
                await self._client.create(secret, namespace=self.namespace)
            except ApiError as exc:
                if exc.status.code != 409:
                    raise
                await self._client.replace(secret, namespace=self.namespace)
        except ApiError as exc:
            raise PoolError(f"cannot create secret {name}: {exc.status.message}") from None
        except httpx2.HTTPError as exc:
            raise PoolError(f"cannot create secret {name}: {type(exc).__name__}: {exc}") from None

    async def _own_secret(self, pod: Pod) -> None:
        """Make the pod the Secret's owner. Should this fail, the Secret is still removed by `stop`."""
        ref = owner_reference(pod.to_dict())
        patch = {"metadata": {"ownerReferences": [OwnerReference(**ref).to_dict()]}}
        try:
            await self._client.patch(
                Secret,
                secret_name(pod.metadata.name),
                patch,
                namespace=self.namespace,
                patch_type=PatchType.MERGE,
            )
        except (ApiError, httpx2.HTTPError) as exc:
            log.warning("cannot make pod %s own its secret (stop removes it): %s", pod.metadata.name, exc)

    async def _delete_pod(self, name: str, grace: int) -> None:
        try:
            await self._client.delete(Pod, name, namespace=self.namespace, grace_period=grace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise PoolError(f"cannot delete pod {self.namespace}/{name}: {exc.status.message}") from None
        except httpx2.HTTPError as exc:
            raise PoolError(
                f"cannot delete pod {self.namespace}/{name}: {type(exc).__name__}: {exc}"
            ) from None

    async def _delete_secret(self, instance_id: str) -> None:
        try:
            await self._client.delete(Secret, secret_name(instance_id), namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                log.warning("cannot delete secret %s: %s", secret_name(instance_id), exc.status.message)
        except httpx2.HTTPError as exc:  # owned by its pod: the garbage collector removes it anyway
            log.warning("cannot delete secret %s: %s", secret_name(instance_id), type(exc).__name__)

    async def _adoptable(self, pod: Pod) -> Running | None:
        meta = pod.metadata
        labels, notes = meta.labels or {}, meta.annotations or {}
        if labels.get(OWNER_LABEL) != self.settings.owner or SNAPSHOT_ANNOTATION not in notes:
            return None
        try:
            secret = await self._client.get(Secret, secret_name(meta.name), namespace=self.namespace)
            key = base64.b64decode((secret.data or {})[KEY_ITEM]).decode()
            started_at = float(notes[STARTED_ANNOTATION])
        except (ApiError, httpx2.HTTPError, KeyError, ValueError) as exc:
            log.warning("pod %s has no whole record (%s); not adopted", meta.name, type(exc).__name__)
            return None
        return Running(
            instance_id=meta.name,
            deployment=labels.get(DEPLOYMENT_LABEL, ""),
            snapshot_id=notes[SNAPSHOT_ANNOTATION],
            handle=PodHandle(self.namespace, meta.name, meta.uid),
            url=f"{scheme(self.engine_tls)}://{pod.status.podIP}:{self.settings.engine_port}",
            secret=key,
            started_at=started_at,
        )

    def held_up(self, handle: PodHandle) -> str | None:
        """From the watch's copy of the pod (`kube_status.held_up`): unschedulable, an image not pulled."""
        pod = self._watch.pods.get(handle.pod)
        return held_up(pod) if pod is not None and pod.metadata.uid == handle.uid else None

    async def device_capacity(self) -> tuple[int, str] | None:
        """The largest allocatable GPU count of any node (tensor parallel stays on one node). A
        cluster whose nodes cannot be listed answers None: then the scheduler decides, and a pod
        that fits nowhere stays Pending with its reason."""
        most, nodes = 0, 0
        try:
            async for node in self._client.list(Node):
                nodes += 1
                allocatable = (node.status.allocatable if node.status is not None else None) or {}
                most = max(most, _count(allocatable.get(self.settings.gpu_resource)))
        except (ApiError, httpx2.HTTPError) as exc:
            log.warning("listing nodes for their GPUs: %s", exc)
            return None
        return most, f"the largest allocatable {self.settings.gpu_resource} of the cluster's {nodes} node(s)"

    async def _some_node_holds(self, snapshot_id: str) -> bool:
        """Whether any node is labelled as holding the snapshot; False where nodes cannot be listed."""
        try:
            async for _ in self._client.list(
                Node, labels={snapshot_label(snapshot_id): "true"}, chunk_size=1
            ):
                return True
        except (ApiError, httpx2.HTTPError) as exc:
            log.debug("listing nodes: %s", exc)
        return False


def _count(quantity: str | None) -> int:
    """An extended resource's quantity ("2") as a count; anything else is none."""
    try:
        return max(int(quantity), 0) if quantity is not None else 0
    except ValueError:
        return 0
