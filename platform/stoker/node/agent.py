"""The node agent (`stoker node`): keeps a GPU node's local snapshot store stocked, and says so.

On Kubernetes each engine pod reads its snapshot from the node's local NVMe store (a hostPath). One
agent per GPU node (a DaemonSet) makes that store hold what deployments use before a pod needs it,
so a scale-up starts at disk speed instead of waiting for a download. Every interval, and at start:

    controller ─GET /cluster/v1/snapshots─▶ wanted ids + s3:// uris   (refused whole unless well formed)
    node store ─ids()─▶ held ids ─merge patch─▶ own Node's labels      (snapshots.stoker.dev/<40 hex>)
    wanted − held ─pull (one at a time), warm─▶ store ─▶ labels again   (a failure waits, doubling)

The scheduler prefers nodes whose labels name a deployment's snapshot. Labels follow the store,
not the controller: a snapshot that leaves the store (evicted, removed) loses its label at the next
sync even while the controller is unreachable. Labels outside our prefix are never touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx2
from lightkube import AsyncClient
from lightkube.core.exceptions import ConfigError
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from snapshots import SnapshotError, SnapshotStore, pagecache
from snapshots.remote import RemoteConfig, pull
from snapshots.s3 import S3Uri
from stoker.http import BearerAuth, nesting_exceeds
from stoker.node.gpu_metrics import register_gpu_metrics
from stoker.tls import TlsSettings, client_context
from warm_pool.backends.kube import snapshot_label
from warm_pool.backends.kube_access import calls
from warm_pool.backends.kube_pod import SNAPSHOT_LABEL_PREFIX
from warm_pool.backoff import restart_delay

log = logging.getLogger("stoker.node")

SNAPSHOTS_PATH = "/cluster/v1/snapshots"
# Bounds on the controller's answer: a cluster with 1000 deployments on distinct snapshots answers
# ~150 kB; anything past these is a broken or hostile controller, refused before it costs memory.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
MAX_SNAPSHOTS = 10_000
MAX_DEPLOYMENTS = 10_000
_ID = re.compile(r"[0-9a-f]{64}")
_OUR_LABEL = re.compile(re.escape(SNAPSHOT_LABEL_PREFIX) + r"[0-9a-f]{40}")  # `snapshot_label`'s form


class ControllerAnswerError(Exception):
    """The controller could not be asked, or its answer was not the agreed shape."""


@dataclass(frozen=True)
class WantedSnapshot:
    id: str
    uri: str | None  # None: the snapshot exists only in some store, so there is nowhere to pull it from
    deployments: tuple[str, ...]


def parse_wanted(raw: bytes) -> list[WantedSnapshot]:
    """The controller's answer, `{"snapshots": [{"id", "uri", "deployments"}]}`, or ControllerAnswerError.

    Every id must be 64 lowercase hex (it becomes a directory name in the store, so "../x" must
    never get that far), every uri an s3:// uri or null, every deployment a string. Keys beyond
    these are ignored, so a newer controller may add some. One bad entry refuses the whole answer:
    acting on part of a broken answer would hide the breakage.
    """
    if len(raw) > MAX_ANSWER_BYTES:
        raise ControllerAnswerError(f"the answer is over {MAX_ANSWER_BYTES} bytes")
    if nesting_exceeds(raw, 8):
        raise ControllerAnswerError("the answer nests deeper than 8 levels")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ControllerAnswerError(f"the answer is not JSON: {exc}") from None
    entries = body.get("snapshots") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        raise ControllerAnswerError('the answer is not an object with a "snapshots" list')
    if len(entries) > MAX_SNAPSHOTS:
        raise ControllerAnswerError(f"the answer lists {len(entries)} snapshots, over {MAX_SNAPSHOTS}")
    return [_wanted(i, entry) for i, entry in enumerate(entries)]


def _wanted(i: int, entry: object) -> WantedSnapshot:
    if not isinstance(entry, dict):
        raise ControllerAnswerError(f"snapshots[{i}] is not an object")
    sid, uri, deployments = entry.get("id"), entry.get("uri"), entry.get("deployments")
    if not isinstance(sid, str) or not _ID.fullmatch(sid):
        raise ControllerAnswerError(f"snapshots[{i}].id is not 64 lowercase hex digits: {sid!r:.80}")
    if uri is not None:
        if not isinstance(uri, str) or not uri.startswith("s3://"):
            raise ControllerAnswerError(f"snapshots[{i}].uri is neither an s3:// uri nor null: {uri!r:.80}")
        try:
            S3Uri.parse(uri)
        except SnapshotError as exc:
            raise ControllerAnswerError(f"snapshots[{i}].uri: {exc}") from None
    if not isinstance(deployments, list) or len(deployments) > MAX_DEPLOYMENTS:
        raise ControllerAnswerError(f"snapshots[{i}].deployments is not a list of at most {MAX_DEPLOYMENTS}")
    if not all(isinstance(name, str) for name in deployments):
        raise ControllerAnswerError(f"snapshots[{i}].deployments holds something other than names")
    return WantedSnapshot(sid, uri, tuple(deployments))


def label_patch(labels: dict[str, str], held: Iterable[str]) -> dict[str, str | None]:
    """The merge patch on `metadata.labels` that makes our labels name exactly the `held` ids:
    a missing one set to "true", a stale one set to None (JSON null deletes it). Empty when
    nothing changes, so a steady node costs one GET per interval and no writes."""
    want = {snapshot_label(sid) for sid in held}
    patch: dict[str, str | None] = {key: "true" for key in want if labels.get(key) != "true"}
    patch.update({key: None for key in labels if _OUR_LABEL.fullmatch(key) and key not in want})
    return patch


@dataclass
class PullBackoff:
    """When a snapshot whose pull failed may be tried again: one interval after the first failure,
    doubling after each one in a row, capped (30 s interval: 30 s, 1 min, 2 min, … 10 min).
    `now` is passed in, monotonic seconds."""

    interval_s: float
    cap_s: float
    _failures: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (in a row, not before)

    def due(self, snapshot_id: str, now: float) -> bool:
        return now >= self._failures.get(snapshot_id, (0, now))[1]

    def failed(self, snapshot_id: str, now: float) -> float:
        """Record a failure; the seconds until the next try."""
        count = self._failures.get(snapshot_id, (0, now))[0] + 1
        delay = restart_delay(count - 1, initial_s=self.interval_s, cap_s=max(self.cap_s, self.interval_s))
        self._failures[snapshot_id] = (count, now + delay)
        return delay

    def succeeded(self, snapshot_id: str) -> None:
        self._failures.pop(snapshot_id, None)


@dataclass(frozen=True)
class AgentConfig:
    controller_url: str
    node_name: str
    interval_s: float = 30.0
    warm: bool = True
    max_backoff_s: float = 600.0
    controller_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.controller_url.startswith(("http://", "https://")):
            raise ValueError(f"the controller URL must be http(s)://..., not {self.controller_url!r}")
        if not self.node_name:
            raise ValueError("the node name must not be empty")
        if not 0 < self.interval_s <= 86400:
            raise ValueError(f"the interval must be in (0 s, 1 d], not {self.interval_s!r}")


class AgentMetrics:
    """The agent's own Prometheus registry: what it holds, how its pulls went, when it last synced."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # The node's GPUs (utilization, memory, temperature, power) where NVML sees any: on a
        # cluster the agent is what runs on every GPU node (`stoker.node.gpu_metrics`).
        register_gpu_metrics(self.registry)
        self.held = Gauge(
            "stoker_node_snapshots_held", "Complete snapshots in this node's store", registry=self.registry
        )
        self.pulls = Counter(
            "stoker_node_pulls", "Snapshot pulls by result (ok, failed)", ["result"], registry=self.registry
        )
        self.pulled_bytes = Counter(
            "stoker_node_pulled_bytes", "Bytes downloaded by snapshot pulls", registry=self.registry
        )
        self.last_sync = Gauge(
            "stoker_node_last_sync_timestamp_seconds",
            "When the last sync ended (Unix time)",
            registry=self.registry,
        )


class NodeAgent:
    """The loop: ask the controller, label the node, pull what is missing. One sync at a time; every
    failure is logged, kept for /healthz and retried, never raised out of `run`."""

    # Every call the agent makes (its own Node read, its labels patched); the chart grants these.
    API_CALLS = calls("", "nodes", "get", "patch", namespaced=False)

    def __init__(
        self,
        config: AgentConfig,
        store: SnapshotStore,
        kube: AsyncClient,
        remote: RemoteConfig,
        admin_key: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        tls: TlsSettings | None = None,  # verifies an https:// controller (`stoker.tls`)
    ) -> None:
        self.config = config
        self._tls = tls
        self.store = store
        self.kube = kube
        self.remote = remote
        self._auth = {"Authorization": f"Bearer {admin_key}"}
        self.clock = clock
        self.wall = wall
        self.backoff = PullBackoff(config.interval_s, config.max_backoff_s)
        self.metrics = AgentMetrics()
        self.last_sync_at: float | None = None
        self.last_errors: list[str] = []
        # Why each wanted snapshot's last pull failed, until one succeeds: /healthz shows it also
        # during the syncs that skip the snapshot while it backs off.
        self.pull_failures: dict[str, str] = {}

    async def run(self) -> None:
        """Sync now, then every interval, until cancelled."""
        timeout = aiohttp.ClientTimeout(total=self.config.controller_timeout_s)
        connector = aiohttp.TCPConnector(ssl=client_context(self._tls))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            while True:
                try:
                    await self.sync(http)
                except Exception as exc:  # a store the agent cannot read, say: keep trying, say why
                    log.exception("sync failed")
                    self.last_errors = [f"sync: {exc}"]
                await asyncio.sleep(self.config.interval_s)

    async def sync(self, http: aiohttp.ClientSession) -> None:
        errors: list[str] = []
        try:
            wanted = await self._ask_controller(http)
        except ControllerAnswerError as exc:
            errors.append(f"controller: {exc}")
            wanted = []
        else:
            ids = {snapshot.id for snapshot in wanted}
            self.pull_failures = {sid: why for sid, why in self.pull_failures.items() if sid in ids}
        await self._report(errors)
        held = set(self.store.ids())
        for snapshot in wanted:
            if snapshot.uri is None or snapshot.id in held or not self.backoff.due(snapshot.id, self.clock()):
                continue
            if await self._pull(snapshot.id, snapshot.uri, errors):
                await self._report(errors)
        for error in errors:
            log.warning("%s", error)
        self.last_errors = errors
        self.last_sync_at = self.wall()
        self.metrics.last_sync.set(self.last_sync_at)

    async def _ask_controller(self, http: aiohttp.ClientSession) -> list[WantedSnapshot]:
        url = self.config.controller_url.rstrip("/") + SNAPSHOTS_PATH
        try:
            async with http.get(url, headers=self._auth, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise ControllerAnswerError(f"GET {url} answered {resp.status}")
                if (resp.content_length or 0) > MAX_ANSWER_BYTES:
                    raise ControllerAnswerError(f"the answer is over {MAX_ANSWER_BYTES} bytes")
                raw = await _read_at_most(resp, MAX_ANSWER_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ControllerAnswerError(f"GET {url} failed: {exc or type(exc).__name__}") from None
        return parse_wanted(raw)

    async def _report(self, errors: list[str]) -> None:
        """Make the node's labels name what the store holds now."""
        held = self.store.ids()
        self.metrics.held.set(len(held))
        name = self.config.node_name
        try:
            node = await self.kube.get(Node, name=name)
            patch = label_patch(dict(node.metadata.labels or {}), held)
            if patch:
                body = {"metadata": {"labels": patch}}
                await self.kube.patch(Node, name, body, patch_type=PatchType.MERGE)
        except (httpx2.HTTPError, ConfigError) as exc:  # lightkube's ApiError is an HTTPError
            errors.append(f"labelling node {name}: {exc}")

    async def _pull(self, snapshot_id: str, uri: str, errors: list[str]) -> bool:
        """Pull (and warm) one snapshot; whether it is now in the store. The pull itself retries
        each request (`RemoteConfig.retry_attempts`); what still fails waits for `self.backoff`."""
        try:
            report = await pull(self.store, uri, self.remote, expected_id=snapshot_id)
        except (SnapshotError, OSError) as exc:
            self.metrics.pulls.labels("failed").inc()
            delay = self.backoff.failed(snapshot_id, self.clock())
            why = f"pulling {snapshot_id[:12]} from {uri}: {exc} (next try in {delay:g} s)"
            self.pull_failures[snapshot_id] = why
            errors.append(why)
            return False
        self.backoff.succeeded(snapshot_id)
        self.pull_failures.pop(snapshot_id, None)
        self.metrics.pulls.labels("ok").inc()
        self.metrics.pulled_bytes.inc(report.bytes_downloaded)
        log.info("pulled %s from %s: %d bytes", snapshot_id[:12], uri, report.bytes_downloaded)
        if self.config.warm:
            await self._warm(snapshot_id, report.path, errors)
        return True

    async def _warm(self, snapshot_id: str, path: Path, errors: list[str]) -> None:
        """Read a pulled snapshot into the page cache (in a thread: it reads every byte). A failure
        costs only speed: the snapshot is in the store and labelled all the same."""
        try:
            await asyncio.to_thread(pagecache.warm, path)
        except SnapshotError as exc:
            errors.append(f"warming {snapshot_id[:12]}: {exc}")

    def health(self) -> dict:
        return {
            "node": self.config.node_name,
            "snapshots": self.store.ids(),
            "last_sync_at": self.last_sync_at,
            "last_error": "; ".join(self.last_errors) or None,
            "pull_failures": dict(self.pull_failures),
        }


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or ControllerAnswerError as soon as it passes `limit` bytes (a chunked answer has no
    Content-Length to refuse it by)."""
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise ControllerAnswerError(f"the answer is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(agent: NodeAgent, admin_key: str) -> BearerAuth:
    """`/healthz` (open: a kubelet probe carries no key) and `/metrics` (the admin key).

    /healthz always answers 200 (a failing pull or an unreachable controller is no reason for the
    kubelet to restart the agent): `{"node", "snapshots": [held ids], "last_sync_at": Unix time or
    null, "last_error": this sync's errors or null, "pull_failures": {id: why, until it succeeds}}`.
    """

    async def healthz(request: Request) -> Response:
        return JSONResponse(agent.health())

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(agent.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app = Starlette(routes=[Route("/healthz", healthz), Route("/metrics", metrics)])
    return BearerAuth(app, admin_key, open_paths=frozenset({"/healthz"}))
