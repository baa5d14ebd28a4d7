"""A Kubernetes API server for the tests, over real HTTP, that refuses what a real one refuses.

Each request goes through the stages a real API server runs, in order; each answers as it would,
with a `Status` object (`code`, `reason`, the API server's `message`):

    authenticate  a bearer token names a user (`tokens`); none, or an unknown one: 401 Unauthorized
    authorize     RBAC (`rbac.Policy`: in the tests, the Helm chart's own Roles and bindings) on
                  the request's verb (get, list, watch, create, update, patch, delete,
                  deletecollection), group, resource or subresource (`pods/log`, `pods/status`)
                  and namespace: 403 Forbidden
    route         a kind (and subresource) not in the table: 404 NotFound
    decode        the body JSON (400); a patch by its content type: JSON merge patch (RFC 7386) or,
                  for built-in kinds, strategic merge patch (`patch`); any other 415 (strategic
                  merge on a custom resource too, as on a cluster)
    validate      the official OpenAPI schema, strict (`schema`): 422 Invalid; a pod's spec is
                  immutable but for images, tolerations added and activeDeadlineSeconds lowered
                  (`updates`): 422 Invalid; a CRD, also as apiextensions checks it (`crd`: its
                  name, one storage version, a structural schema per served version); a custom
                  resource, pruned, defaulted and validated against its CRD version's
                  `openAPIV3Schema` instead (`openapi`), 422 in the API server's words;
                  finalizer names, and none added to an object being deleted (`finalizers`)
    admit         a namespaced object needs its Namespace (404); a new pod, the Pod Security level
                  its namespace's label enforces (`podsecurity`): 403 Forbidden
    store         one resourceVersion counter; a replace or patch with a stale resourceVersion is
                  409 Conflict; a create of an existing name 409 AlreadyExists; `dryRun=All` stops
                  before this, storing nothing

What the cluster does besides answering:

- watch: from a resourceVersion, what followed it; from none, the current objects as ADDED; from
  one older than the history kept, an ERROR event with 410 Expired (`compact()` forces that);
- the scheduler (`scheduler`): a new pod is bound where it fits (its requests against each node's
  `status.allocatable` less what the pods bound there ask, taints and tolerations, node affinity
  and selectors); one that fits nowhere stays Pending, `PodScheduled=False, Unschedulable`, with
  the scheduler's message, and is tried again whenever a node is added or changed or a pod stops
  holding its node's resources (it ends, or goes);
- deletion: a pod bound to a node gets a `deletionTimestamp` and is removed by the kubelet (grace
  0) once its processes are gone; the garbage collector deletes an object once every owner named
  in its `ownerReferences` is gone (a terminating owner still counts: background deletion);
- finalizers (`finalizers`): a delete of any object with `metadata.finalizers` sets its
  `deletionTimestamp` and `deletionGracePeriodSeconds: 0` (a MODIFIED event, 200 with the object)
  instead of removing it, as does the garbage collector; a second delete changes nothing; an update
  that leaves no finalizers, once the grace period is over (a pod: its kubelet deleted it with grace
  0), removes it (DELETED, 200 with the final object); other updates go through, status writes too
  but never remove it; adding a finalizer then, or one that is not a qualified name (a bare one on a
  built-in kind but `kubernetes`, `orphan`, `foregroundDeletion`), is 422 Invalid in the API
  server's words; `deletionTimestamp` and `deletionGracePeriodSeconds` are the server's: a client's
  are dropped;
- subresources: `pods/status`, `nodes/status` and `namespaces/status` change only status (and a
  write of the object itself never does); `pods/log` serves the files the fake kubelet writes in
  `log_dir` (a real API server proxies the kubelet);
- custom resources: a CRD created (`/apis/apiextensions.k8s.io/v1/customresourcedefinitions`) is
  answered `NamesAccepted` and `Established`, and each served version's kind joins the table, at
  `/apis/<group>/<version>/[namespaces/<ns>/]<plural>[/<name>[/status]]` (a namespaced one's list
  and watch across namespaces too); with a `status` subresource, a create or a write of the object
  ignores `.status` and a write of `/status` everything else; `metadata.generation` starts at 1
  and is bumped when anything but metadata (and status, where it is a subresource) changes; a CRD
  replaced is served anew; a CRD deleted gets the `customresourcecleanup.apiextensions.k8s.io`
  finalizer and `Terminating=True` (a create of its kind is then 405), its custom resources are
  deleted (those with finalizers stay, terminating), and once the last is gone it is removed and its
  paths answer 404 again (a client removing the cleanup finalizer itself drops what is left).

Every request is recorded: `requests` (method, path, query), `responses` (status codes) and
`calls` (who asked for what, and whether RBAC allowed it), so tests can see what a client did.

Kinds are a table (`kinds`; `FakeApiServer(kinds=...)` takes others): Pods, Secrets, ConfigMaps
(at most 1 MiB of data and binaryData, as a real one), Nodes, Namespaces, Leases and
CustomResourceDefinitions, and the kinds of every CRD registered.

Not modelled: for custom resources, conversion between versions (each object is answered in the
version it was written in), the scale subresource, printer columns in Table answers, CEL rules,
`format`, list-type and embedded-resource extensions, a CRD's names clashing with another's, and the
rest `crd` and `openapi` list; any kind not in the table (404); server-side apply and JSON patch
(415); field selectors and set-based label selectors (clients filter by equality labels); defaulting
(objects are stored as sent: no default dnsPolicy, and requests taken from limits are counted by the
scheduler but not written); `generateName`; deletion options (`propagationPolicy`: foreground
deletion and orphaning, `preconditions`, a grace period shortened but not to 0) and the 422 a real
server answers a client setting `deletionTimestamp` on a live object (the fake ignores it);
`Warning` headers (a real server warns of a bare finalizer name on a custom resource); namespace
deletion and what it removes; Pod Security's warn and audit modes, exemptions, and checks of pod
updates; preemption, pod (anti-)affinity, topology spread, host ports and the scorers beyond
preferred node affinity; NoExecute eviction of running pods; the Node authorizer and NodeRestriction
(the kubelet calls as admin); aggregated ClusterRoles; admission webhooks; ResourceQuota and
LimitRange; discovery (`/api`, `/apis`, `/version`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.deadlines import SERVER_START
from tests.kube.fake import crd, finalizers, podsecurity, scheduler
from tests.kube.fake.kinds import KINDS, NAMESPACE_SUBRESOURCES, Kind
from tests.kube.fake.patch import PatchError, merge_patch, strategic_merge_patch
from tests.kube.fake.rbac import Attributes, Policy, User, forbidden_message
from tests.kube.fake.schema import SchemaError, validate
from tests.kube.fake.updates import invalid_message, pod_update_errors

HISTORY = 1000  # watch events kept for resumption; older versions answer 410 Expired
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
TERMINATED = ("Succeeded", "Failed")
CRDS = "customresourcedefinitions.apiextensions.k8s.io"


class ApiStatus(Exception):
    """An error answered as a Kubernetes `Status`."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def body(self) -> dict:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _builtin(kind: Kind) -> bool:
    """Validated by the core API's rules (standard finalizer names), not apiextensions'."""
    return kind.openapi is None and kind.resource != CRDS


def _qualified(kind: Kind) -> str:
    """The kind as a 422 message names it: `Pod`, `Widget.stoker.dev`."""
    return f"{kind.kind}.{kind.group}" if kind.group else kind.kind


def _finalized(current: dict, updated: dict) -> bool:
    """An update that removes the object: it is terminating, its grace period is over (a pod's
    kubelet is done) and the update leaves no finalizers."""
    meta = current["metadata"]
    return (
        bool(meta.get("deletionTimestamp"))
        and meta.get("deletionGracePeriodSeconds") in (None, 0)
        and not updated["metadata"].get("finalizers")
    )


def _set_condition(obj: dict, kind: str, status: str, reason: str, message: str) -> None:
    condition = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now_iso(),
    }
    conditions = obj.setdefault("status", {}).setdefault("conditions", [])
    conditions[:] = [*(c for c in conditions if c["type"] != kind), condition]


def labels_match(labels: dict, selector: str | None) -> bool:
    """Equality-based label selectors (`a=b,c!=d,e,!f`), the subset our clients send."""
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass(frozen=True)
class Call:
    """One request as RBAC saw it."""

    user: str
    attrs: Attributes
    allowed: bool


@dataclass(frozen=True)
class Target:
    """What a request's path names."""

    kind: Kind
    namespace: str
    name: str
    subresource: str


@dataclass
class Store:
    """Every object, the event history and the live watchers; one resourceVersion counter."""

    version: int = 0
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (resource, ns, name)
    history: list[tuple[int, str, str, dict]] = field(default_factory=list)  # (rv, resource, type, obj)
    compacted: int = 0  # watches from a version below this answer 410
    watchers: set[asyncio.Queue] = field(default_factory=set)

    def bump(self) -> str:
        self.version += 1
        return str(self.version)

    def emit(self, resource: str, kind: str, obj: dict) -> None:
        event = (int(obj["metadata"]["resourceVersion"]), resource, kind, copy.deepcopy(obj))
        self.history.append(event)
        if len(self.history) > HISTORY:
            self.compacted = self.history.pop(0)[0]
        for queue in self.watchers:
            queue.put_nowait(event)

    def of(self, resource: str) -> list[dict]:
        return [o for (r, _, _), o in self.objects.items() if r == resource]


class FakeApiServer:
    """The API's state plus the Starlette app serving it. `serve()` runs it on loopback.

    `tokens` maps each bearer token to the user it authenticates (`rbac.ADMIN` for the harness and
    the kubelet, `rbac.service_account(...)` for each process under test); `policy` is the RBAC
    they are held to (by default none: only `system:masters` may do anything)."""

    def __init__(
        self,
        log_dir: Path,
        *,
        tokens: Mapping[str, User],
        policy: Policy | None = None,
        kinds: tuple[Kind, ...] = KINDS,
    ) -> None:
        self.log_dir = log_dir
        self.tokens = dict(tokens)
        self.policy = policy or Policy()
        self.kinds = {(k.group, k.version, k.plural): k for k in kinds}
        self._by_plural = {k.resource: k for k in kinds}  # a CR's: its storage version's
        self.store = Store()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, query): what the clients did
        self.responses: list[int] = []  # and the status of each answer
        self.calls: list[Call] = []
        self._scheduling = False
        self.app = Starlette(
            routes=[Route("/{path:path}", self._serve, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]
        )
        self.url = ""

    # -- state changes, also used directly by tests to set the scene -------------------------------

    def put(self, resource: str, obj: dict, event: str) -> dict:
        meta = obj["metadata"]
        meta["resourceVersion"] = self.store.bump()
        self.store.objects[(resource, meta.get("namespace", ""), meta["name"])] = obj
        self.store.emit(resource, event, obj)
        if meta.get("ownerReferences"):
            self._collect_garbage()  # its owners may be gone already
        if resource == "nodes" or (resource == "pods" and obj.get("status", {}).get("phase") in TERMINATED):
            self.schedule_pending()  # room may have appeared
        return obj

    def add_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict:
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        return self._create(self._kind("namespaces"), "", ns)

    def add_node(
        self,
        name: str,
        labels: dict[str, str] | None = None,
        *,
        allocatable: dict[str, str] | None = None,
        taints: list[dict] | None = None,
    ) -> dict:
        """A Ready node; `allocatable` beyond the default 8 CPUs, 32 GiB and 110 pods (a GPU node:
        `{"nvidia.com/gpu": "2"}`), `taints` as the API spells them."""
        node: dict = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
        if taints:
            node["spec"] = {"taints": taints}
        capacity = {"cpu": "8", "memory": "32Gi", "pods": "110", **(allocatable or {})}
        ready = {"type": "Ready", "status": "True", "lastTransitionTime": now_iso()}
        node["status"] = {"capacity": capacity, "allocatable": capacity, "conditions": [ready]}
        return self._create(self._kind("nodes"), "", node)

    def compact(self) -> None:
        """Forget the history, as etcd compaction does: resuming a watch from any version now is 410."""
        self.store.compacted = self.store.version + 1
        self.store.history.clear()

    def drop_watches(self) -> None:
        """End every open watch stream, as an API server restart or a load balancer would."""
        for queue in list(self.store.watchers):
            queue.put_nowait(None)

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        return self.store.objects.get((resource, namespace, name))

    def remove(self, resource: str, namespace: str, name: str) -> dict:
        obj = self.store.objects.pop((resource, namespace, name))
        obj["metadata"]["resourceVersion"] = self.store.bump()
        self.store.emit(resource, "DELETED", obj)
        if resource == CRDS:  # what is left of its custom resources goes with it, then its paths
            for key in [k for k in self.store.objects if k[0] == name]:
                self.remove(*key)
            self._unregister(name)
        else:
            self._finish_definition(resource)  # its CRD waits for its last custom resource
        self._collect_garbage()
        if resource == "pods":
            self.schedule_pending()
        return obj

    def schedule_pending(self) -> None:
        """Bind every pod not yet bound that fits somewhere now, oldest first; say why of the rest."""
        if self._scheduling:
            return
        self._scheduling = True
        try:
            for pod in [p for p in self.store.of("pods") if not p["spec"].get("nodeName")]:
                if pod["metadata"].get("deletionTimestamp"):
                    continue
                nodes = self.store.of("nodes")
                bound: dict[str, list[dict]] = {}
                for other in self.store.of("pods"):
                    if (
                        other["spec"].get("nodeName")
                        and other.get("status", {}).get("phase") not in TERMINATED
                    ):
                        bound.setdefault(other["spec"]["nodeName"], []).append(other)
                decision = scheduler.schedule(pod["spec"], nodes, bound)
                self._record_decision(copy.deepcopy(pod), decision)
        finally:
            self._scheduling = False

    def _record_decision(self, pod: dict, decision: scheduler.Decision) -> None:
        condition = {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_iso()}
        if decision.node is None:
            condition.update(status="False", reason="Unschedulable", message=decision.message)
        else:
            pod["spec"]["nodeName"] = decision.node
        status = pod.setdefault("status", {"phase": "Pending"})
        old = next((c for c in status.get("conditions") or [] if c["type"] == "PodScheduled"), None)
        if (
            decision.node is None
            and old is not None
            and (old.get("reason"), old.get("message"))
            == (
                condition["reason"],
                condition["message"],
            )
        ):
            return  # nothing new to say
        status["conditions"] = [
            *(c for c in status.get("conditions") or [] if c["type"] != "PodScheduled"),
            condition,
        ]
        self.put("pods", pod, "MODIFIED")

    def _create(self, kind: Kind, namespace: str, obj: dict, *, dry_run: bool = False) -> dict:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            raise ApiStatus(
                422, "Invalid", f"{kind.kind} metadata.name: Required value: name or generateName is required"
            )
        errors = finalizers.name_errors(meta.get("finalizers") or [], builtin=_builtin(kind))
        if errors:
            raise ApiStatus(422, "Invalid", invalid_message(_qualified(kind), meta["name"], errors))
        for server_set in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(server_set, None)
        if kind.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise ApiStatus(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = namespace
            if self.get("namespaces", "", namespace) is None:
                raise ApiStatus(404, "NotFound", f'namespaces "{namespace}" not found')
        if (kind.resource, namespace, meta["name"]) in self.store.objects:
            raise ApiStatus(409, "AlreadyExists", f'{kind.resource} "{meta["name"]}" already exists')
        if kind.plural == "pods":
            self._admit_pod(namespace, obj)
            obj["status"] = {"phase": "Pending"}  # a client does not say how its pod is doing
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso())
        if kind.openapi is not None or kind.resource == CRDS:
            meta["generation"] = 1
            if "status" in kind.subresources:
                obj.pop("status", None)  # a create, like a write of the object, never sets status
        if kind.resource == CRDS:
            obj["status"] = crd.accepted(obj, now_iso())
        if dry_run:
            return obj
        created = self.put(kind.resource, obj, "ADDED")
        if kind.resource == CRDS:
            self._register(created)
        if kind.plural == "pods":
            answer = copy.deepcopy(created)
            self.schedule_pending()
            return answer
        return created

    def _admit_pod(self, namespace: str, pod: dict) -> None:
        labels = self.get("namespaces", "", namespace)["metadata"].get("labels") or {}
        level, version = podsecurity.policy(labels)
        refusal = podsecurity.refusal(pod["spec"], level, version)
        if refusal is not None:
            raise ApiStatus(403, "Forbidden", f'pods "{pod["metadata"]["name"]}" is forbidden: {refusal}')

    def _collect_garbage(self) -> None:
        """Delete each object all of whose owners are gone (one pass per removal: it recurses): one
        without finalizers is removed, one with them is marked terminating. A terminating owner
        still exists (background deletion)."""
        uids = {o["metadata"]["uid"] for o in self.store.objects.values()}
        for key, obj in list(self.store.objects.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if not owners or any(ref.get("uid") in uids for ref in owners) or key not in self.store.objects:
                continue
            meta = self.store.objects[key]["metadata"]
            if not meta.get("finalizers"):
                self.remove(*key)
            elif not meta.get("deletionTimestamp"):
                self._delete_one(self._kind(key[0]), copy.deepcopy(self.store.objects[key]), None)

    def _finish_definition(self, name: str) -> None:
        """A terminating CRD whose last custom resource is gone: drop the cleanup finalizer, and
        remove the CRD if no other finalizer holds it."""
        current = self.get(CRDS, "", name)
        if (
            current is None
            or finalizers.CRD_CLEANUP not in (current["metadata"].get("finalizers") or [])
            or any(k[0] == name for k in self.store.objects)
        ):
            return
        definition = copy.deepcopy(current)
        meta = definition["metadata"]
        meta["finalizers"] = [f for f in meta["finalizers"] if f != finalizers.CRD_CLEANUP]
        _set_condition(
            definition, "Terminating", "False", "InstanceDeletionCompleted", "removed all instances"
        )
        if meta["finalizers"]:
            self.put(CRDS, definition, "MODIFIED")
        else:
            self.store.objects[(CRDS, "", name)] = definition
            self.remove(CRDS, "", name)

    def _kind(self, resource: str) -> Kind:
        return self._by_plural[resource]

    def _register(self, definition: dict) -> None:
        """Serve the CRD's kinds (again, after a change: its versions and schemas may differ)."""
        self._unregister(definition["metadata"]["name"])
        stored = next(v["name"] for v in definition["spec"]["versions"] if v.get("storage"))
        for kind in crd.kinds_of(definition):
            self.kinds[(kind.group, kind.version, kind.plural)] = kind
            if kind.version == stored or kind.resource not in self._by_plural:
                self._by_plural[kind.resource] = kind

    def _unregister(self, resource: str) -> None:
        for key in [
            k for k, kind in self.kinds.items() if kind.openapi is not None and kind.resource == resource
        ]:
            del self.kinds[key]
        self._by_plural.pop(resource, None)

    # -- HTTP ---------------------------------------------------------------------------------------

    async def _serve(self, request: Request) -> Response:
        self.requests.append((request.method, request.url.path, request.url.query))
        try:
            response = await self._answer(request)
        except ApiStatus as exc:
            response = JSONResponse(exc.body(), exc.code)
        self.responses.append(response.status_code)
        return response

    async def _answer(self, request: Request) -> Response:
        user = self._authenticate(request)
        group, version, namespace, plural, name, sub = self._parse(request.url.path)
        attrs = self._attributes(request, group, namespace, plural, name, sub)
        allowed = self.policy.allows(user, attrs)
        self.calls.append(Call(user.name, attrs, allowed))
        if not allowed:
            raise ApiStatus(403, "Forbidden", forbidden_message(user, attrs))
        kind = self.kinds.get((group, version, plural))
        across = attrs.verb in ("list", "watch") and not namespace  # a namespaced kind in every namespace
        if kind is None or (kind.namespaced != bool(namespace) and not (kind.namespaced and across)):
            raise ApiStatus(404, "NotFound", "the server could not find the requested resource")
        if sub and sub not in kind.subresources:
            raise ApiStatus(404, "NotFound", "the server could not find the requested resource")
        handler: Callable[[Request, Target], Awaitable[Response]] = {
            "get": self._get,
            "list": self._list,
            "watch": self._watch,
            "create": self._post,
            "update": self._update,
            "patch": self._update,
            "delete": self._delete,
            "deletecollection": self._delete_collection,
        }[attrs.verb]
        return await handler(request, Target(kind, namespace, name, sub))

    def _authenticate(self, request: Request) -> User:
        header = request.headers.get("authorization", "")
        user = self.tokens.get(header.removeprefix("Bearer ")) if header.startswith("Bearer ") else None
        if user is None:
            raise ApiStatus(401, "Unauthorized", "Unauthorized")
        return user

    @staticmethod
    def _parse(path: str) -> tuple[str, str, str, str, str, str]:
        """(group, version, namespace, plural, name, subresource), as RequestInfo reads a path."""
        parts = [p for p in path.split("/") if p]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiStatus(404, "NotFound", "the server could not find the requested resource")
        namespace = ""
        if len(rest) > 2 and rest[0] == "namespaces" and rest[2] not in NAMESPACE_SUBRESOURCES:
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise ApiStatus(404, "NotFound", "the server could not find the requested resource")
        name, sub = [*rest[1:], "", ""][:2]
        return group, version, namespace, rest[0], name, sub

    @staticmethod
    def _attributes(
        request: Request, group: str, namespace: str, plural: str, name: str, sub: str
    ) -> Attributes:
        watching = request.query_params.get("watch") in ("true", "1")
        verb = {
            "GET": "get" if name else ("watch" if watching else "list"),
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection",
        }[request.method]
        if plural == "namespaces" and name:
            namespace = name  # RBAC sees a Namespace's name as the namespace of a request on it
        return Attributes(verb, group, plural, sub, namespace, name)

    async def _get(self, request: Request, where: Target) -> Response:
        current = self._existing(where)
        if where.subresource == "log":
            return self._log(request, current)
        return JSONResponse(current)

    def _selected(self, where: Target, selector: str | None) -> list[dict]:
        return [
            o
            for (r, ns, _), o in sorted(self.store.objects.items())
            if r == where.kind.resource
            and (not where.namespace or ns == where.namespace)
            and labels_match(o["metadata"].get("labels") or {}, selector)
        ]

    async def _list(self, request: Request, where: Target) -> Response:
        return JSONResponse(
            {
                "apiVersion": where.kind.api_version,
                "kind": f"{where.kind.kind}List",
                "metadata": {"resourceVersion": str(self.store.version)},
                "items": self._selected(where, request.query_params.get("labelSelector")),
            }
        )

    async def _post(self, request: Request, where: Target) -> Response:
        if where.name:
            raise ApiStatus(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        definition = self.get(CRDS, "", where.kind.resource) if where.kind.openapi is not None else None
        if definition is not None and definition["metadata"].get("deletionTimestamp"):
            raise ApiStatus(
                405, "MethodNotAllowed", "create not allowed while custom resource definition is terminating"
            )
        obj = self._validate(await self._body(request), where.kind)
        dry_run = request.query_params.get("dryRun") == "All"
        return JSONResponse(self._create(where.kind, where.namespace, obj, dry_run=dry_run), 201)

    async def _update(self, request: Request, where: Target) -> Response:
        """PUT (update) and PATCH (patch), of the object or of its status."""
        if not where.name or where.subresource == "log":
            raise ApiStatus(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        current = self._existing(where)
        body = await self._body(request)
        if request.method == "PUT":
            if body.get("metadata", {}).get("name") != where.name:
                raise ApiStatus(
                    400,
                    "BadRequest",
                    f"the name of the object ({body.get('metadata', {}).get('name')}) does not match the name on the URL ({where.name})",
                )
            updated = body
            sent = body["metadata"].get("resourceVersion")
        else:
            updated = self._patched(request, where.kind, current, body)
            sent = (body.get("metadata") or {}).get("resourceVersion")
        if sent is not None and sent != current["metadata"]["resourceVersion"]:
            raise ApiStatus(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {where.kind.resource} "{where.name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )
        server_set = (
            "uid",
            "creationTimestamp",
            "namespace",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        )
        meta = {k: v for k, v in updated.get("metadata", {}).items() if k not in server_set}
        meta.update({k: current["metadata"][k] for k in server_set if k in current["metadata"]})
        if where.subresource == "status":  # a status write changes only status
            updated = {**current, "status": updated.get("status")} if updated.get("status") else current
        else:
            updated = {**updated, "metadata": meta}
            if "status" in where.kind.subresources:
                updated["status"] = current.get("status")  # and a write of the object never status
                if updated["status"] is None:
                    del updated["status"]
        updated = self._validate(updated, where.kind)
        if "generation" in current["metadata"]:  # bumped when anything but metadata (and status) changes
            ignored = ("metadata", "status") if "status" in where.kind.subresources else ("metadata",)
            changed = {k: v for k, v in updated.items() if k not in ignored} != {
                k: v for k, v in current.items() if k not in ignored
            }
            updated["metadata"] = {
                **updated["metadata"],
                "generation": current["metadata"]["generation"] + int(changed),
            }
        if where.subresource != "status":
            old, new = (o["metadata"].get("finalizers") or [] for o in (current, updated))
            errors = finalizers.name_errors(new, builtin=_builtin(where.kind))
            if current["metadata"].get("deletionTimestamp"):
                errors += finalizers.added_errors(old, new)
            if where.kind.plural == "pods":
                errors += pod_update_errors(current["spec"], updated.get("spec") or {})
            if errors:
                raise ApiStatus(422, "Invalid", invalid_message(_qualified(where.kind), where.name, errors))
        if request.query_params.get("dryRun") == "All":
            return JSONResponse(updated)
        if where.subresource != "status" and _finalized(current, updated):
            self.store.objects[(where.kind.resource, where.namespace, where.name)] = updated
            return JSONResponse(self.remove(where.kind.resource, where.namespace, where.name))
        stored = self.put(where.kind.resource, updated, "MODIFIED")
        if where.kind.resource == CRDS:
            self._register(stored)
        return JSONResponse(stored)

    def _existing(self, where: Target) -> dict:
        obj = self.store.objects.get((where.kind.resource, where.namespace, where.name))
        if obj is None:
            raise ApiStatus(404, "NotFound", f'{where.kind.resource} "{where.name}" not found')
        return copy.deepcopy(obj)

    def _patched(self, request: Request, kind: Kind, current: dict, patch: dict) -> dict:
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        try:
            if content_type == MERGE:
                return merge_patch(current, patch)  # type: ignore[return-value]
            if content_type == STRATEGIC and kind.schema is not None:
                return strategic_merge_patch(current, patch, kind.schema)
        except PatchError as exc:
            raise ApiStatus(422, "Invalid", str(exc)) from None
        accepted = [MERGE, STRATEGIC] if kind.schema is not None else [MERGE]
        raise ApiStatus(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}",
        )

    async def _delete(self, request: Request, where: Target) -> Response:
        if where.subresource:
            raise ApiStatus(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        obj = self._existing(where)
        if request.query_params.get("dryRun") == "All":
            return JSONResponse(obj)
        return JSONResponse(self._delete_one(where.kind, obj, request.query_params.get("gracePeriodSeconds")))

    async def _delete_collection(self, request: Request, where: Target) -> Response:
        grace = request.query_params.get("gracePeriodSeconds")
        for obj in self._selected(where, request.query_params.get("labelSelector")):
            self._delete_one(where.kind, copy.deepcopy(obj), grace)
        return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})

    def _delete_one(self, kind: Kind, obj: dict, grace: str | None) -> dict:
        """Remove `obj`, or mark it terminating: a pod bound to a node until its kubelet is done
        (grace > 0), anything with finalizers until they are gone (grace 0)."""
        meta = obj["metadata"]
        ns, name = meta.get("namespace", ""), meta["name"]
        if kind.resource == CRDS and not meta.get("deletionTimestamp"):
            return self._delete_definition(obj)
        grace_s = 0
        if kind.plural == "pods":
            grace_s = (
                int(grace) if grace is not None else obj["spec"].get("terminationGracePeriodSeconds", 30)
            )
            if obj.get("status", {}).get("phase") in TERMINATED or not obj["spec"].get("nodeName"):
                grace_s = 0
        if meta.get("deletionTimestamp"):
            if grace_s > 0 or meta.get("deletionGracePeriodSeconds") == 0:
                return obj  # already terminating: its kubelet or its finalizers' owners finish it
            meta["deletionGracePeriodSeconds"] = 0  # the kubelet is done with it
        elif grace_s > 0 or meta.get("finalizers"):
            meta.update(deletionTimestamp=now_iso(), deletionGracePeriodSeconds=grace_s)
            return self.put(kind.resource, obj, "MODIFIED")
        if meta.get("finalizers"):
            return self.put(kind.resource, obj, "MODIFIED")
        return self.remove(kind.resource, ns, name)

    def _delete_definition(self, definition: dict) -> dict:
        """A CRD deleted waits for its custom resources, as apiextensions' finalizer does: each is
        deleted (those with finalizers stay, terminating), and the CRD goes after the last."""
        meta, name = definition["metadata"], definition["metadata"]["name"]
        meta.update(deletionTimestamp=now_iso(), deletionGracePeriodSeconds=0)
        meta["finalizers"] = [*(meta.get("finalizers") or []), finalizers.CRD_CLEANUP]
        _set_condition(
            definition,
            "Terminating",
            "True",
            "InstanceDeletionInProgress",
            "CustomResource deletion is in progress",
        )
        answer = copy.deepcopy(self.put(CRDS, definition, "MODIFIED"))
        kind = self._by_plural.get(name)
        for key in [k for k in self.store.objects if k[0] == name]:
            if kind is not None and key in self.store.objects:
                self._delete_one(kind, copy.deepcopy(self.store.objects[key]), None)
        self._finish_definition(name)
        return answer

    def _log(self, request: Request, pod: dict) -> Response:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        names = [c["name"] for c in (pod["spec"].get("initContainers") or []) + pod["spec"]["containers"]]
        container = request.query_params.get("container") or pod["spec"]["containers"][0]["name"]
        if container not in names:
            raise ApiStatus(400, "BadRequest", f"container {container} is not valid for pod {name}")
        path = self.log_dir / f"{ns}_{name}_{container}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        tail = request.query_params.get("tailLines")
        if tail is not None:
            text = "".join(text.splitlines(keepends=True)[-int(tail) :]) if int(tail) else ""
        return PlainTextResponse(text)

    async def _body(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise ApiStatus(400, "BadRequest", f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiStatus(400, "BadRequest", "the body is not a JSON object")
        return body

    @staticmethod
    def _validate(obj: dict, kind: Kind) -> dict:
        """`obj` as it will be stored (a custom resource pruned and defaulted), or 422 Invalid."""
        if obj.get("kind") != kind.kind or obj.get("apiVersion") != kind.api_version:
            raise ApiStatus(
                400,
                "BadRequest",
                f"the object is a {obj.get('apiVersion')} {obj.get('kind')}, not a {kind.api_version} {kind.kind}",
            )
        if kind.openapi is not None:
            try:
                return crd.admit(obj, kind)
            except crd.CustomResourceInvalid as exc:
                raise ApiStatus(422, "Invalid", str(exc)) from None
        try:
            validate(obj)
        except SchemaError as exc:
            raise ApiStatus(422, "Invalid", str(exc)) from None
        if kind.resource == CRDS:
            errors = crd.definition_errors(obj)
            if errors:
                name = obj["metadata"].get("name", "")
                raise ApiStatus(422, "Invalid", invalid_message(f"{kind.kind}.{kind.group}", name, errors))
        return obj

    async def _watch(self, request: Request, where: Target) -> Response:
        params = request.query_params
        resource, ns, selector = where.kind.resource, where.namespace, params.get("labelSelector")
        since = params.get("resourceVersion")
        timeout = float(params.get("timeoutSeconds") or 300)
        queue: asyncio.Queue = asyncio.Queue()
        if since in (None, "", "0"):
            backlog = [
                (0, r, "ADDED", copy.deepcopy(o))
                for (r, _, _), o in sorted(self.store.objects.items())
                if r == resource
            ]
        elif int(since) < self.store.compacted:
            expired = ApiStatus(410, "Expired", f"too old resource version: {since} ({self.store.compacted})")
            line = json.dumps({"type": "ERROR", "object": expired.body()}) + "\n"
            return StreamingResponse(iter([line]), media_type="application/json")
        else:
            backlog = [e for e in self.store.history if e[0] > int(since) and e[1] == resource]
        for event in backlog:
            queue.put_nowait(event)
        self.store.watchers.add(queue)

        def wanted(obj: dict) -> bool:
            meta = obj["metadata"]
            return (not ns or meta.get("namespace") == ns) and labels_match(
                meta.get("labels") or {}, selector
            )

        async def stream() -> AsyncIterator[str]:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                    except TimeoutError:
                        return
                    if event is None:
                        return
                    _, r, kind, obj = event
                    if r == resource and wanted(obj):
                        yield json.dumps({"type": kind, "object": obj}) + "\n"
            finally:
                self.store.watchers.discard(queue)

        return StreamingResponse(stream(), media_type="application/json")

    # -- serving ------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        """Serve on a free loopback port for the block; yields the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        end = asyncio.get_running_loop().time() + SERVER_START
        while not server.started:
            if task.done():
                task.result()  # its exception, if it failed to start
                raise RuntimeError("the fake API server's uvicorn ended before it started serving")
            if asyncio.get_running_loop().time() > end:
                task.cancel()
                raise TimeoutError(f"the fake API server did not start serving within {SERVER_START:g} s")
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            yield self.url
        finally:
            self.drop_watches()
            server.should_exit = True
            await task
            sock.close()
