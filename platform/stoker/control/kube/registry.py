"""Deployments and their revisions in the API server: the SQLite `Registry`'s interface
(`stoker.control.registry`) over StokerDeployment and StokerRevision resources.

    StokerDeployment <name>       spec: the deploy body (`stoker deploy` writes it, or `kubectl apply`)
                                  status: the controller's (`stoker.control.kube.reconcile`), the
                                  split serving now among it (`status.traffic`: what a new leader
                                  restores)
    StokerRevision <name>-r<N>    one per revision: its settings and snapshot, owned by the deployment

Reads come from the mirrors (`stoker.control.kube.mirror`). A write carries the resourceVersion the
mirror holds: when someone applied the resource meanwhile the API server answers 409 and so does
the deploy ("deploy again"), never overwriting what they applied. The split is written to the
status by the reconciler's status loop, soon after `set_traffic` (`on_traffic` wakes it).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.types import PatchType

from stoker.control.kube.errors import conflict, refused
from stoker.control.kube.kinds import (
    API_VERSION,
    DEPLOYMENT_LABEL,
    FINALIZER,
    MANAGED,
    REVISION_LABEL,
    StokerDeployment,
    StokerRevision,
)
from stoker.control.kube.mirror import Mirror
from stoker.errors import APIError, invalid
from stoker.spec.deployment import ADAPTER_FIELDS, DEPLOY_FIELDS, DeploymentSpec, validate
from stoker.spec.resources import (
    GROUP,
    KIND,
    PLURAL,
    REVISION_PLURAL,
    from_resource,
    object_name_error,
    revision_object_name,
    to_resource,
)
from warm_pool.backends.kube_access import calls

log = logging.getLogger("stoker.kube")


def deploy_body(spec: DeploymentSpec) -> dict[str, Any]:
    """A revision's deploy fields (no name, no snapshot, no revision), nulls left out; an adapter's
    source as `adapter`, as its deploy gave it."""
    if spec.base is not None:
        fields = spec.to_dict()
        body = {k: v for k, v in fields.items() if k in ADAPTER_FIELDS and k != "name" and v is not None}
        return {**body, "adapter": fields["model"]}
    return {k: v for k, v in spec.to_dict().items() if k in DEPLOY_FIELDS and k != "name" and v is not None}


def declares(resource: dict[str, Any], spec: DeploymentSpec) -> bool:
    """Whether the resource's spec asks for exactly what `spec` is (its snapshot aside)."""
    try:
        fields = validate(from_resource(spec.name, resource.get("spec") or {}))
    except APIError:
        return False
    same = DeploymentSpec.from_dict({**fields, "snapshot_id": spec.snapshot_id, "revision": spec.revision})
    return same == spec


def _epoch(stamp: str | None) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0


def terminating(obj: dict[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


class ResourceRegistry:
    """The registry on a cluster (see the module). `start()` the mirrors (a standby does, to be
    warm) and `wait_synced` before the platform starts; `bind` the reconciler."""

    API_CALLS = (
        calls(GROUP, PLURAL, "get", "list", "watch", "create", "update", "patch", "delete")
        | calls(GROUP, f"{PLURAL}/status", "patch")
        | calls(GROUP, REVISION_PLURAL, "list", "watch", "create", "delete")
    )

    def __init__(self, client: AsyncClient, namespace: str, *, retry_s: float = 1.0) -> None:
        self._client, self.namespace = client, namespace
        self.deployments = Mirror(client, StokerDeployment, namespace, retry_s=retry_s)
        self._revisions = Mirror(client, StokerRevision, namespace, labels=MANAGED, retry_s=retry_s)
        self._traffic: dict[str, dict[int, int]] = {}  # set here, not yet in a status the mirror holds
        self._pending: dict[str, tuple[int, int]] = {}  # a switch under way (revision, percent)
        self._on_traffic: Callable[[str], None] = lambda name: None

    def bind(self, on_change: Callable[[str], None], on_traffic: Callable[[str], None]) -> None:
        """Who hears of a changed StokerDeployment (the reconciler's queue) and of a new split."""
        self.deployments.on_change = on_change
        self._on_traffic = on_traffic

    def start(self) -> None:
        self.deployments.start()
        self._revisions.start()

    async def wait_synced(self, timeout_s: float) -> None:
        await self.deployments.wait_synced(timeout_s)
        await self._revisions.wait_synced(timeout_s)

    async def aclose(self) -> None:
        await self.deployments.close()
        await self._revisions.close()

    def close(self) -> None:
        """The platform's shutdown: the mirrors close with the controller (`aclose`)."""

    # ---- reads -------------------------------------------------------------------------------

    def _revision_objects(self, name: str) -> list[dict[str, Any]]:
        """`name`'s revisions, oldest first: those its current resource owns (one left by a
        deployment of the same name deleted before is not its)."""
        owner = self.deployments.get(name)
        uid = owner["metadata"].get("uid") if owner is not None else None
        out = []
        for obj in self._revisions.objects.values():
            if (obj["metadata"].get("labels") or {}).get(DEPLOYMENT_LABEL) != name:
                continue
            owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
            if uid is not None and uid in owners:
                out.append(obj)
        return sorted(out, key=lambda o: o["spec"]["revision"])

    @staticmethod
    def _spec(obj: dict[str, Any]) -> DeploymentSpec | None:
        s = dict(obj["spec"])
        name, number, snapshot = s.pop("deployment"), s.pop("revision"), s.pop("snapshotId")
        fields = from_resource(name, s)
        if "adapter" in fields:  # an adapter's source, which its spec keeps as `model`
            fields["model"] = fields.pop("adapter")
        try:
            return DeploymentSpec.from_dict({**fields, "snapshot_id": snapshot, "revision": number})
        except (TypeError, ValueError) as exc:  # written by another version, or by hand
            log.error("revision %s unreadable, left out: %s", obj["metadata"]["name"], exc)
            return None

    def revisions(self, name: str) -> list[tuple[DeploymentSpec, float]]:
        out = []
        for obj in self._revision_objects(name):
            spec = self._spec(obj)
            if spec is not None:
                out.append((spec, _epoch(obj["metadata"].get("creationTimestamp"))))
        return out

    def revision(self, name: str, number: int) -> DeploymentSpec | None:
        return next((spec for spec, _ in self.revisions(name) if spec.revision == number), None)

    def traffic(self, name: str) -> dict[int, int]:
        if name in self._traffic:
            return dict(self._traffic[name])
        obj = self.deployments.get(name)
        status = (obj or {}).get("status") or {}
        return {int(k): int(v) for k, v in (status.get("traffic") or {}).items()}

    def _ordered(self) -> list[dict[str, Any]]:
        objs = [o for o in self.deployments.objects.values() if not terminating(o)]
        return sorted(
            objs, key=lambda o: (o["metadata"].get("creationTimestamp") or "", o["metadata"]["name"])
        )

    def all(self) -> list[DeploymentSpec]:
        """Each deployment's newest revision (one declared but not yet made has none)."""
        out = []
        for obj in self._ordered():
            history = self.revisions(obj["metadata"]["name"])
            if history:
                out.append(history[-1][0])
        return out

    def serving(self) -> list[DeploymentSpec]:
        out = []
        for obj in self._ordered():
            name = obj["metadata"]["name"]
            traffic = self.traffic(name)
            out += [spec for spec, _ in self.revisions(name) if traffic.get(spec.revision, 0) > 0]
        return out

    # ---- writes ------------------------------------------------------------------------------

    def set_traffic(self, name: str, traffic: dict[int, int]) -> None:
        self._traffic[name] = dict(traffic)
        self._on_traffic(name)

    def set_pending_switch(self, name: str, switch: tuple[int, int] | None) -> None:
        """Kept in memory only: on a cluster a controller restarted in the middle of a switch
        leaves the traffic where it was (the declared resource is applied again)."""
        if switch is None:
            self._pending.pop(name, None)
        else:
            self._pending[name] = switch

    def pending_switch(self, name: str) -> tuple[int, int] | None:
        return self._pending.get(name)

    def traffic_written(self, name: str, traffic: dict[int, int]) -> None:
        """The status now holds `traffic` (the status loop wrote it)."""
        if self._traffic.get(name) == traffic:
            del self._traffic[name]

    async def create_revision(self, spec: DeploymentSpec, *, take_traffic: bool = False) -> DeploymentSpec:
        if (why := object_name_error(spec.name)) is not None:
            raise invalid(why[0].upper() + why[1:] + ".", "name")
        owner = await self._declare(spec)
        history = self._revision_objects(spec.name)
        latest = history[-1]["spec"]["revision"] if history else 0
        spec = DeploymentSpec.from_dict({**spec.to_dict(), "revision": latest + 1})
        revision = {
            "apiVersion": API_VERSION,
            "kind": "StokerRevision",
            "metadata": {
                "name": revision_object_name(spec.name, spec.revision),
                "namespace": self.namespace,
                "labels": {**MANAGED, DEPLOYMENT_LABEL: spec.name, REVISION_LABEL: str(spec.revision)},
                "ownerReferences": [
                    {
                        "apiVersion": API_VERSION,
                        "kind": KIND,
                        "name": spec.name,
                        "uid": owner["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "deployment": spec.name,
                "revision": spec.revision,
                "snapshotId": spec.snapshot_id,
                **to_resource(deploy_body(spec)),
            },
        }
        try:
            made = await self._client.create(StokerRevision(revision), namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 409:
                raise conflict("deployment", spec.name, exc) from None
            raise refused(f"revision {spec.revision} of {spec.name!r}", exc) from None
        self._revisions.put(made.to_dict())
        if take_traffic or latest == 0:
            self.set_traffic(spec.name, {spec.revision: 100})
        return spec

    async def _declare(self, spec: DeploymentSpec) -> dict[str, Any]:
        """The StokerDeployment asking for `spec`: as it is when it does (a resource applied,
        which the reconciler is making), else written, over the version the mirror holds."""
        current = self.deployments.get(spec.name)
        if current is not None and terminating(current):
            raise APIError(
                409,
                f"The deployment {spec.name!r} is being deleted; deploy it again once it is gone.",
                param="name",
                code="deployment_deleting",
            )
        if current is not None and declares(current, spec):
            return current
        wanted = to_resource(deploy_body(spec))
        try:
            if current is None:
                obj = {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "metadata": {"name": spec.name, "namespace": self.namespace, "finalizers": [FINALIZER]},
                    "spec": wanted,
                }
                made = await self._client.create(StokerDeployment(obj), namespace=self.namespace)
            else:
                obj = copy.deepcopy(current)
                obj.pop("status", None)
                obj["spec"] = wanted
                finalizers = obj["metadata"].get("finalizers") or []
                obj["metadata"]["finalizers"] = (
                    [*finalizers, FINALIZER] if FINALIZER not in finalizers else finalizers
                )
                made = await self._client.replace(StokerDeployment(obj), namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 409:
                raise conflict("deployment", spec.name, exc) from None
            raise refused(f"the deployment {spec.name!r}", exc) from None
        made = made.to_dict()
        self.deployments.put(made)
        return made

    async def put(self, spec: DeploymentSpec) -> DeploymentSpec:
        return await self.create_revision(spec, take_traffic=True)

    async def hold(self, name: str) -> None:
        """Put the finalizer on a resource that lacks it (one applied with kubectl): its deletion
        then waits for the drain."""
        current = self.deployments.get(name)
        if current is None or terminating(current):
            return
        finalizers = current["metadata"].get("finalizers") or []
        if FINALIZER in finalizers:
            return
        patch = {
            "metadata": {
                "finalizers": [*finalizers, FINALIZER],
                "resourceVersion": current["metadata"]["resourceVersion"],
            }
        }
        try:
            made = await self._client.patch(
                StokerDeployment, name, patch, namespace=self.namespace, patch_type=PatchType.MERGE
            )
        except ApiError as exc:
            if exc.status.code in (404, 409):  # gone, or changed: its next event comes back here
                return
            raise
        self.deployments.put(made.to_dict())

    async def delete(self, name: str) -> None:
        """After the drain: its revisions deleted, the deployment deleted and let go (the finalizer
        off), so that a `kubectl delete` waiting on it returns."""
        for obj in self._revision_objects_any(name):
            try:
                await self._client.delete(StokerRevision, obj["metadata"]["name"], namespace=self.namespace)
            except ApiError as exc:
                if exc.status.code != 404:
                    raise refused(f"revision {obj['metadata']['name']}", exc) from None
            self._revisions.forget(obj["metadata"]["name"])
        self._traffic.pop(name, None)
        for _ in range(5):  # a finalizer someone else added meanwhile is kept: read again, retry
            try:
                current = self.deployments.get(name)
                if current is not None and not terminating(current):
                    await self._client.delete(StokerDeployment, name, namespace=self.namespace)
                current = (await self._client.get(StokerDeployment, name, namespace=self.namespace)).to_dict()
                finalizers = [f for f in current["metadata"].get("finalizers") or [] if f != FINALIZER]
                version = current["metadata"]["resourceVersion"]
                patch = {"metadata": {"finalizers": finalizers, "resourceVersion": version}}
                await self._client.patch(
                    StokerDeployment, name, patch, namespace=self.namespace, patch_type=PatchType.MERGE
                )
            except ApiError as exc:
                if exc.status.code == 404:  # gone: deleted, its finalizers all off
                    break
                if exc.status.code != 409:
                    raise refused(f"the deletion of {name!r}", exc) from None
                continue
            break
        else:
            raise APIError(
                409, f"The deployment {name!r} kept changing while it was deleted.", code="conflict"
            )
        self.deployments.forget(name)

    def _revision_objects_any(self, name: str) -> list[dict[str, Any]]:
        return [
            o
            for o in self._revisions.objects.values()
            if (o["metadata"].get("labels") or {}).get(DEPLOYMENT_LABEL) == name
        ]

    async def write_status(self, name: str, status: dict[str, Any]) -> None:
        """The status subresource, merged (only the leader writes it)."""
        try:
            await self._client.patch(
                StokerDeployment.Status,
                name,
                {"status": status},
                namespace=self.namespace,
                patch_type=PatchType.MERGE,
            )
        except ApiError as exc:
            if exc.status.code != 404:  # gone meanwhile
                raise
