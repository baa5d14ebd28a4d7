"""A small Kubernetes API server for the tests: pods, secrets, leases and nodes, over real HTTP.

Faithful where our clients depend on it, and nowhere else:

- bearer-token authentication (401 otherwise) and errors as the API sends them: a `Status` object
  with `code` and `reason` (NotFound, AlreadyExists, Conflict, Invalid, Expired, Unauthorized);
- every object a client writes (create, replace, patch, status patch) is checked against the
  official OpenAPI schemas with `kubernetes_validate` (strict: unknown fields are errors) and
  refused with 422 Invalid, so a field we misspell fails here as it would on a cluster;
- one global, monotonically increasing resourceVersion; replace with a stale resourceVersion is
  409 Conflict; list returns the collection's resourceVersion; watch from a version replays what
  followed it, from none sends the current objects as ADDED first, and from a version older than
  the retained history answers an ERROR event with a 410 Expired Status (as the API does once
  etcd compacted it: `compact()` forces that);
- deleting a pod that runs on a node sets `deletionTimestamp` and leaves it to the kubelet, which
  deletes it again with grace 0 once its process is gone; secrets whose ownerReferences name a
  removed pod are garbage-collected with it;
- a trivial scheduler binds a pod at creation: nodes that fail `nodeSelector` or a required node
  affinity term are filtered out, the rest scored by the weights of the preferred terms they match
  (ties by name); none left is `PodScheduled=False, Unschedulable`.

Patches (merge and strategic merge) are applied as JSON merge patches (RFC 7386): the fields our
clients patch (labels, annotations, ownerReferences, pod status) are maps or lists written whole.
`pods/log` serves the files the fake kubelet writes in `log_dir` (a real API server proxies the
kubelet). Field selectors are not supported: clients filter by labels.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import kubernetes_validate
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.deadlines import SERVER_START

SCHEMA_VERSION = "1.33.0"
HISTORY = 1000  # watch events kept for resumption; older versions answer 410 Expired


@dataclass(frozen=True)
class Kind:
    kind: str
    group: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"


KINDS = {  # by plural
    "pods": Kind("Pod", "", True),
    "secrets": Kind("Secret", "", True),
    "nodes": Kind("Node", "", False),
    "leases": Kind("Lease", "coordination.k8s.io", True),
}


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


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386: maps merge recursively, null removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def labels_match(labels: dict, selector: str | None) -> bool:
    """Equality-based label selectors (`a=b,c!=d,e`), the subset our clients send."""
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


def _expression_matches(labels: dict, expr: dict) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise ApiStatus(422, "Invalid", f"node selector operator {op!r} is not supported by the fake")


def _term_matches(labels: dict, term: dict) -> bool:
    return all(_expression_matches(labels, e) for e in term.get("matchExpressions") or [])


def schedule(pod: dict, nodes: list[dict]) -> str | None:
    """The node the pod goes to: feasible by nodeSelector and required affinity, best by the summed
    weights of the preferred terms it matches, ties broken by name; None if no node fits."""
    spec = pod["spec"]
    affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
    preferred = affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    best: tuple[int, str] | None = None
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        labels = node["metadata"].get("labels") or {}
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            continue
        if required and not any(_term_matches(labels, t) for t in required):
            continue
        score = sum(p["weight"] for p in preferred if _term_matches(labels, p["preference"]))
        if best is None or score > best[0]:
            best = (score, node["metadata"]["name"])
    return None if best is None else best[1]


@dataclass
class Store:
    """Every object, the event history and the live watchers; one resourceVersion counter."""

    version: int = 0
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (plural, ns, name)
    history: list[tuple[int, str, str, dict]] = field(default_factory=list)  # (rv, plural, type, obj)
    compacted: int = 0  # watches from a version below this answer 410
    watchers: set[asyncio.Queue] = field(default_factory=set)

    def bump(self) -> str:
        self.version += 1
        return str(self.version)

    def emit(self, plural: str, kind: str, obj: dict) -> None:
        event = (int(obj["metadata"]["resourceVersion"]), plural, kind, copy.deepcopy(obj))
        self.history.append(event)
        if len(self.history) > HISTORY:
            self.compacted = self.history.pop(0)[0]
        for queue in self.watchers:
            queue.put_nowait(event)


class FakeApiServer:
    """The API's state plus the Starlette app serving it. `serve()` runs it on loopback."""

    def __init__(self, token: str, log_dir: Path) -> None:
        self.token = token
        self.log_dir = log_dir
        self.store = Store()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, query): what the clients did
        self.responses: list[int] = []  # and the status of each answer
        self.app = Starlette(routes=self._routes())
        self.url = ""

    # -- state changes, also used directly by tests to set the scene -------------------------------

    def put(self, plural: str, obj: dict, event: str) -> dict:
        meta = obj["metadata"]
        meta["resourceVersion"] = self.store.bump()
        self.store.objects[(plural, meta.get("namespace", ""), meta["name"])] = obj
        self.store.emit(plural, event, obj)
        return obj

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> dict:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
        return self._create("nodes", "", node)

    def compact(self) -> None:
        """Forget the history, as etcd compaction does: resuming a watch from any version now is 410."""
        self.store.compacted = self.store.version + 1
        self.store.history.clear()

    def drop_watches(self) -> None:
        """End every open watch stream, as an API server restart or a load balancer would."""
        for queue in list(self.store.watchers):
            queue.put_nowait(None)

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        return self.store.objects.get((plural, namespace, name))

    def _create(self, plural: str, namespace: str, obj: dict) -> dict:
        kind = KINDS[plural]
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            raise ApiStatus(422, "Invalid", f"{kind.kind} metadata.name: Required value")
        if kind.namespaced:
            meta["namespace"] = namespace
        if (plural, namespace, meta["name"]) in self.store.objects:
            raise ApiStatus(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso())
        if plural == "pods":
            self._bind(obj)
        return self.put(plural, obj, "ADDED")

    def _bind(self, pod: dict) -> None:
        nodes = [o for (p, _, _), o in self.store.objects.items() if p == "nodes"]
        node = schedule(pod, nodes)
        condition = {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_iso()}
        if node is None:
            message = f"0/{len(nodes)} nodes are available: none matches the pod's node affinity/selector."
            condition.update(status="False", reason="Unschedulable", message=message)
        else:
            pod["spec"]["nodeName"] = node
        pod["status"] = {"phase": "Pending", "conditions": [condition]}

    def remove(self, plural: str, namespace: str, name: str) -> dict:
        obj = self.store.objects.pop((plural, namespace, name))
        obj["metadata"]["resourceVersion"] = self.store.bump()
        self.store.emit(plural, "DELETED", obj)
        if plural == "pods":
            self._collect_garbage(obj["metadata"]["uid"])
        return obj

    def _collect_garbage(self, owner_uid: str) -> None:
        for (plural, ns, name), obj in list(self.store.objects.items()):
            if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or []):
                self.remove(plural, ns, name)

    # -- HTTP ---------------------------------------------------------------------------------------

    def _routes(self) -> list[Route]:
        return [
            Route("/api/v1/{plural}", self.collection, methods=["GET", "POST"]),
            Route("/api/v1/{plural}/{name}", self.item, methods=["GET", "PUT", "PATCH", "DELETE"]),
            Route("/api/v1/namespaces/{ns}/{plural}", self.collection, methods=["GET", "POST"]),
            Route(
                "/api/v1/namespaces/{ns}/{plural}/{name}",
                self.item,
                methods=["GET", "PUT", "PATCH", "DELETE"],
            ),
            Route("/api/v1/namespaces/{ns}/pods/{name}/status", self.pod_status, methods=["PATCH"]),
            Route("/api/v1/namespaces/{ns}/pods/{name}/log", self.pod_log, methods=["GET"]),
            Route("/apis/{group}/v1/namespaces/{ns}/{plural}", self.collection, methods=["GET", "POST"]),
            Route(
                "/apis/{group}/v1/namespaces/{ns}/{plural}/{name}",
                self.item,
                methods=["GET", "PUT", "PATCH", "DELETE"],
            ),
        ]

    async def _guard(self, request: Request, handler: Callable) -> Response:
        self.requests.append((request.method, request.url.path, request.url.query))
        if request.headers.get("authorization") != f"Bearer {self.token}":
            response: Response = JSONResponse(ApiStatus(401, "Unauthorized", "Unauthorized").body(), 401)
        else:
            try:
                response = await handler(request)
            except ApiStatus as exc:
                response = JSONResponse(exc.body(), exc.code)
        self.responses.append(response.status_code)
        return response

    def _kind(self, request: Request) -> tuple[str, str, Kind]:
        params = request.path_params
        kind = KINDS.get(params["plural"])
        if kind is None or kind.group != params.get("group", "") or kind.namespaced != ("ns" in params):
            raise ApiStatus(
                404, "NotFound", f"the server could not find the requested resource {request.url.path}"
            )
        return params["plural"], params.get("ns", ""), kind

    async def collection(self, request: Request) -> Response:
        return await self._guard(request, self._collection)

    async def _collection(self, request: Request) -> Response:
        plural, ns, kind = self._kind(request)
        if request.method == "POST":
            obj = await self._body(request)
            self._validate(obj)
            return JSONResponse(self._create(plural, ns, obj), 201)
        selector = request.query_params.get("labelSelector")
        if request.query_params.get("watch") in ("true", "1"):
            return self._watch(plural, ns, selector, request.query_params)
        items = [
            o
            for (p, n, _), o in sorted(self.store.objects.items())
            if p == plural
            and (not ns or n == ns)
            and labels_match(o["metadata"].get("labels") or {}, selector)
        ]
        return JSONResponse(
            {
                "apiVersion": kind.api_version,
                "kind": f"{kind.kind}List",
                "metadata": {"resourceVersion": str(self.store.version)},
                "items": items,
            }
        )

    async def item(self, request: Request) -> Response:
        return await self._guard(request, self._item)

    async def _item(self, request: Request) -> Response:
        plural, ns, _ = self._kind(request)
        name = request.path_params["name"]
        current = self._existing(plural, ns, name)
        if request.method == "GET":
            return JSONResponse(current)
        if request.method == "DELETE":
            return JSONResponse(
                self._delete(plural, ns, current, request.query_params.get("gracePeriodSeconds"))
            )
        body = await self._body(request)
        if request.method == "PUT":
            sent = body["metadata"].get("resourceVersion")
            if sent is not None and sent != current["metadata"]["resourceVersion"]:
                raise ApiStatus(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again",
                )
            server_set = {k: current["metadata"][k] for k in ("uid", "creationTimestamp", "namespace")}
            updated = {**body, "metadata": {**body["metadata"], **{k: v for k, v in server_set.items() if v}}}
        else:
            updated = self._patched(request, current, body)
        self._validate(updated)
        return JSONResponse(self.put(plural, updated, "MODIFIED"))

    def _existing(self, plural: str, ns: str, name: str) -> dict:
        obj = self.store.objects.get((plural, ns, name))
        if obj is None:
            raise ApiStatus(404, "NotFound", f'{plural} "{name}" not found')
        return copy.deepcopy(obj)

    def _patched(self, request: Request, current: dict, patch: dict) -> dict:
        content_type = request.headers.get("content-type", "")
        if content_type not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            raise ApiStatus(415, "UnsupportedMediaType", f"the fake does not apply {content_type!r} patches")
        return merge_patch(current, patch)  # type: ignore[return-value]

    def _delete(self, plural: str, ns: str, obj: dict, grace: str | None) -> dict:
        name = obj["metadata"]["name"]
        if plural != "pods":
            self.remove(plural, ns, name)
            return obj
        grace_s = int(grace) if grace is not None else obj["spec"].get("terminationGracePeriodSeconds", 30)
        terminal = obj.get("status", {}).get("phase") in ("Succeeded", "Failed")
        if grace_s == 0 or terminal or not obj["spec"].get("nodeName"):
            return self.remove(plural, ns, name)
        if obj["metadata"].get("deletionTimestamp"):
            return obj  # already terminating: the kubelet finishes it
        obj["metadata"].update(deletionTimestamp=now_iso(), deletionGracePeriodSeconds=grace_s)
        return self.put(plural, obj, "MODIFIED")

    async def pod_status(self, request: Request) -> Response:
        async def handler(request: Request) -> Response:
            ns, name = request.path_params["ns"], request.path_params["name"]
            current = self._existing("pods", ns, name)
            patch = await self._body(request)
            updated = merge_patch(current, {"status": patch.get("status", {})})
            self._validate(updated)  # type: ignore[arg-type]
            return JSONResponse(self.put("pods", updated, "MODIFIED"))  # type: ignore[arg-type]

        return await self._guard(request, handler)

    async def pod_log(self, request: Request) -> Response:
        async def handler(request: Request) -> Response:
            ns, name = request.path_params["ns"], request.path_params["name"]
            pod = self._existing("pods", ns, name)
            container = request.query_params.get("container") or pod["spec"]["containers"][0]["name"]
            path = self.log_dir / f"{ns}_{name}_{container}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            tail = request.query_params.get("tailLines")
            if tail is not None:
                text = "".join(text.splitlines(keepends=True)[-int(tail) :]) if int(tail) else ""
            return PlainTextResponse(text)

        return await self._guard(request, handler)

    async def _body(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise ApiStatus(400, "BadRequest", f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiStatus(400, "BadRequest", "the body is not a JSON object")
        return body

    def _validate(self, obj: dict) -> None:
        try:
            kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            raise ApiStatus(422, "Invalid", f"{obj.get('kind')} {where}: {exc.message}") from None
        if obj.get("kind") == "Secret":
            for key, value in (obj.get("data") or {}).items():
                try:
                    base64.b64decode(value, validate=True)
                except ValueError:
                    raise ApiStatus(422, "Invalid", f"Secret data.{key}: not base64") from None

    def _watch(self, plural: str, ns: str, selector: str | None, params) -> Response:
        since = params.get("resourceVersion")
        timeout = float(params.get("timeoutSeconds") or 300)
        queue: asyncio.Queue = asyncio.Queue()
        if since in (None, "", "0"):
            backlog = [
                (0, p, "ADDED", copy.deepcopy(o))
                for (p, _, _), o in sorted(self.store.objects.items())
                if p == plural
            ]
        elif int(since) < self.store.compacted:
            expired = ApiStatus(410, "Expired", f"too old resource version: {since} ({self.store.compacted})")
            line = json.dumps({"type": "ERROR", "object": expired.body()}) + "\n"
            return StreamingResponse(iter([line]), media_type="application/json")
        else:
            backlog = [e for e in self.store.history if e[0] > int(since) and e[1] == plural]
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
                    _, p, kind, obj = event
                    if p == plural and wanted(obj):
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
