"""The node agent (`stoker node`): pulls what deployments use into the node's store, labels the Node.

Real parts on loopback, all but moto in this process: a moto S3 server (its own process), the fake
Kubernetes API server (tests/kube/fake/apiserver.py: nodes, merge patches, every written object
checked against the API's schemas; the agent calls with the node agent's token, held to the RBAC
the Helm chart gives its service account), and a tiny Starlette app standing in for the
controller's `GET /cluster/v1/snapshots` (the controller's own endpoint is tested on its own; here
it answers whatever a test sets). The agent runs as `stoker node` builds it: its kubeconfig read
from a file, its sync loop beside its uvicorn server. Waits are for an observable change (a label,
a sync's timestamp), with generous deadlines; the interval only sets how often the agent looks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import httpx
import pytest
import uvicorn
from lightkube import AsyncClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from snapshots import SnapshotStore
from snapshots.importer import import_hf_dir
from snapshots.remote import RemoteConfig, push
from stoker.cli.node import _kube_config, register, serve_node
from stoker.cli.parser import StokerParser
from stoker.errors import CLIError
from stoker.http import make_server
from stoker.node.agent import (
    MAX_ANSWER_BYTES,
    AgentConfig,
    ControllerAnswerError,
    NodeAgent,
    PullBackoff,
    build_app,
    label_patch,
    parse_wanted,
)
from tests.deadlines import WAIT, deadline
from tests.kube.accounts import TOKENS, chart_access, tokens, unexplained
from tests.kube.fake.apiserver import FakeApiServer
from tests.snapshots.s3_support import MotoServer, aws_env, free_port
from warm_pool.backends.kube import snapshot_label
from warm_pool.backends.kube_pod import SNAPSHOT_LABEL_PREFIX

BUCKET = "node-agent"
ADMIN_KEY = "node-agent-admin-key"
KUBE_TOKEN = TOKENS["node"]  # the node agent's service account
NODE = "gpu-node-1"
UNRELATED = {"kubernetes.io/hostname": NODE, "team": "ml", "snapshots.stoker.dev/keep-me": "yes"}
ID_A, ID_B = "a" * 64, "b" * 64


# --- pure parts: tables ----------------------------------------------------------------------------


def entry(sid: str = ID_A, uri: object = "s3://bucket/prefix", deployments: object = ("chat",)) -> dict:
    return {
        "id": sid,
        "uri": uri,
        "deployments": list(deployments) if isinstance(deployments, tuple) else deployments,
    }


def answer(*entries: object) -> bytes:
    return json.dumps({"snapshots": list(entries)}).encode()


def test_a_well_formed_answer_is_read_whole():
    raw = answer(entry(), entry(ID_B, None, ()), {**entry(), "id": "c" * 64, "newer_field": 1})
    wanted = parse_wanted(raw)
    assert [(w.id, w.uri, w.deployments) for w in wanted] == [
        (ID_A, "s3://bucket/prefix", ("chat",)),
        (ID_B, None, ()),
        ("c" * 64, "s3://bucket/prefix", ("chat",)),
    ]


BAD_ANSWERS = {
    "not json": b"{nope",
    "a list, not an object": json.dumps([entry()]).encode(),
    "no snapshots key": json.dumps({"snapshot": [entry()]}).encode(),
    "snapshots not a list": json.dumps({"snapshots": {"id": ID_A}}).encode(),
    "an entry not an object": answer(entry(), "x"),
    "path traversal id": answer(entry(), entry("../x")),
    "short id": answer(entry("a" * 63)),
    "uppercase id": answer(entry("A" * 64)),
    "id with a slash": answer(entry("a" * 62 + "/a")),
    "id not a string": answer(entry(7)),
    "file uri": answer(entry(uri="file:///etc")),
    "http uri": answer(entry(uri="http://bucket/prefix")),
    "s3 uri without a bucket": answer(entry(uri="s3://")),
    "uri not a string": answer(entry(uri=["s3://b/p"])),
    "deployments missing": json.dumps({"snapshots": [{"id": ID_A, "uri": None}]}).encode(),
    "deployments not names": answer(entry(deployments=[1])),
    "deep nesting": b'{"snapshots": [' + b"[" * 50 + b"]" * 50 + b"]}",
    "oversized": answer(entry(deployments=["x" * MAX_ANSWER_BYTES])),
}


@pytest.mark.parametrize("raw", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
def test_a_bad_answer_is_refused_whole(raw: bytes):
    with pytest.raises(ControllerAnswerError):
        parse_wanted(raw)


def test_the_label_names_the_first_40_hex_digits():
    assert snapshot_label(ID_A) == SNAPSHOT_LABEL_PREFIX + "a" * 40
    assert len(snapshot_label(ID_A).split("/")[1]) <= 63  # Kubernetes' limit on a label's name


@pytest.mark.parametrize(
    ("labels", "held", "patch"),
    [
        ({}, [], {}),
        (UNRELATED, [ID_A], {snapshot_label(ID_A): "true"}),
        ({**UNRELATED, snapshot_label(ID_A): "true"}, [ID_A], {}),  # steady: no write
        (
            {**UNRELATED, snapshot_label(ID_A): "true"},
            [ID_B],
            {snapshot_label(ID_B): "true", snapshot_label(ID_A): None},
        ),
        ({snapshot_label(ID_A): "false"}, [ID_A], {snapshot_label(ID_A): "true"}),
        (UNRELATED, [], {}),  # `snapshots.stoker.dev/keep-me` is not one of ours: not 40 hex
    ],
)
def test_label_patch(labels, held, patch):
    assert label_patch(labels, held) == patch


def test_pull_backoff_doubles_from_the_interval_up_to_the_cap_and_resets_on_success():
    backoff = PullBackoff(interval_s=30, cap_s=100)
    assert backoff.due(ID_A, now=0)
    assert [backoff.failed(ID_A, now=0) for _ in range(4)] == [30, 60, 100, 100]
    assert not backoff.due(ID_A, now=99) and backoff.due(ID_A, now=100)
    assert backoff.due(ID_B, now=0)  # one snapshot's failures do not hold back another
    backoff.succeeded(ID_A)
    assert backoff.due(ID_A, now=0) and backoff.failed(ID_A, now=0) == 30


# --- the CLI ---------------------------------------------------------------------------------------


def node_args(*extra: str) -> argparse.Namespace:
    parser = StokerParser(prog="stoker")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(
        ["node", "--store", "/tmp/s", "--controller", "http://127.0.0.1:1", "--node-name", NODE, *extra]
    )


def test_missing_admin_key_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("STOKER_ADMIN_KEY", raising=False)
    args = node_args("--interval", "5s", "--no-warm")
    assert (args.interval, args.warm, args.port) == (5.0, False, 8082)
    with pytest.raises(CLIError) as caught:
        args.func(args)
    message = str(caught.value)
    assert "STOKER_ADMIN_KEY" in message and "\n" not in message


def test_an_unreadable_kubeconfig_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("STOKER_ADMIN_KEY", ADMIN_KEY)
    args = node_args("--kubeconfig", str(tmp_path / "missing"))
    with pytest.raises(CLIError, match="--kubeconfig") as caught:
        args.func(args)
    assert "\n" not in str(caught.value)


# --- real parts on loopback ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving(app) -> AsyncIterator[str]:
    """`app` on a free loopback port for the block, in this event loop; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@dataclass
class Controller:
    """Stands in for the controller's `GET /cluster/v1/snapshots`: answers `body` with `status` to the
    admin key, 401 to anything else, and counts what it was asked."""

    body: bytes = answer()
    status: int = 200
    asked: int = 0
    auth_seen: set[str] = field(default_factory=set)

    def app(self) -> Starlette:
        async def snapshots(request: Request) -> Response:
            self.asked += 1
            self.auth_seen.add(request.headers.get("authorization", ""))
            if request.headers.get("authorization") != f"Bearer {ADMIN_KEY}":
                return Response(status_code=401)
            return Response(self.body, self.status, media_type="application/json")

        return Starlette(routes=[Route("/cluster/v1/snapshots", snapshots)])


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    boto3.client(
        "s3",
        endpoint_url=server.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)
    yield server
    server.kill()


@pytest.fixture
def s3_env(moto, tmp_path, monkeypatch) -> None:
    """moto's endpoint and test credentials, where the agent's `RemoteConfig.from_env()` finds them."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in aws_env({}, tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)


def make_model(dst: Path) -> Path:
    """A config, a tokenizer file (salted: every model is a new snapshot) and 256 KiB of float32."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (dst / "tokenizer.json").write_text(json.dumps({"version": "1.0", "salt": uuid.uuid4().hex}))
    n = 64 * 1024
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + os.urandom(4 * n))
    return dst


def new_snapshot(tmp_path: Path, store: SnapshotStore) -> str:
    return import_hf_dir(make_model(tmp_path / f"model-{uuid.uuid4().hex[:8]}"), store).id


async def publish(publisher: SnapshotStore, sid: str, uri: str) -> None:
    await push(publisher, sid, uri, RemoteConfig.from_env(retry_backoff_s=0.05))


@dataclass
class Scene:
    kube: FakeApiServer
    controller: Controller
    controller_url: str
    kubeconfig: Path
    store: SnapshotStore
    tmp_path: Path

    def labels(self) -> dict[str, str]:
        return dict(self.kube.get("nodes", "", NODE)["metadata"].get("labels") or {})

    def our_labels(self) -> set[str]:
        return {k for k in self.labels() if k not in UNRELATED}


@pytest.fixture
async def scene(tmp_path) -> AsyncIterator[Scene]:
    access = chart_access()
    kube = FakeApiServer(tmp_path, tokens=tokens(access), policy=access.policy)
    controller = Controller()
    async with kube.serve() as kube_url, serving(controller.app()) as controller_url:
        kube.add_node(NODE, dict(UNRELATED))
        kube.add_node("gpu-node-2", {"team": "other"})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps(kubeconfig_for(kube_url)))
        store = SnapshotStore(tmp_path / "node-store")
        yield Scene(kube, controller, controller_url, kubeconfig, store, tmp_path)
    assert unexplained(kube.calls, access) == []  # the agent did only what its code declares


def kubeconfig_for(url: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "agent", "user": {"token": KUBE_TOKEN}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
        "current-context": "fake",
    }


@dataclass
class RunningAgent:
    agent: NodeAgent
    url: str

    async def get(self, path: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(
            timeout=deadline(10)
        ) as client:  # async: the agent serves from this loop
            return await client.get(f"{self.url}{path}", headers=headers)

    async def health(self) -> dict:
        r = await self.get("/healthz")
        assert r.status_code == 200, r.text
        return r.json()

    async def metrics(self) -> str:
        r = await self.get("/metrics", ADMIN_KEY)
        assert r.status_code == 200, r.text
        return r.text

    async def next_sync(self, within_s: float = WAIT) -> dict:
        """/healthz after a whole sync that began after this call."""
        before = self.agent.last_sync_at
        await until(lambda: self.agent.last_sync_at != before, "a sync to end", within_s)
        before = self.agent.last_sync_at
        await until(lambda: self.agent.last_sync_at != before, "another whole sync", within_s)
        return await self.health()


@contextlib.asynccontextmanager
async def running_agent(scene: Scene, *, warm: bool = True) -> AsyncIterator[RunningAgent]:
    """The agent as `stoker node` assembles it (stoker.cli.node), on a short interval and backoff cap."""
    config = AgentConfig(scene.controller_url, NODE, interval_s=0.05, warm=warm, max_backoff_s=0.5)
    kube = AsyncClient(config=_kube_config(str(scene.kubeconfig)))
    agent = NodeAgent(config, scene.store, kube, RemoteConfig.from_env(retry_backoff_s=0.05), ADMIN_KEY)
    port = free_port()
    server = make_server(
        build_app(agent, ADMIN_KEY), host="127.0.0.1", port=port, log_level="warning", grace_period_s=1
    )
    task = asyncio.create_task(serve_node(agent, server))
    try:
        await until(lambda: server.started, "the agent's server to start")
        yield RunningAgent(agent, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        await task
        await kube.close()


async def until(condition: Callable[[], bool], what: str, within_s: float = WAIT) -> None:
    end = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}: not within {within_s:g} s")
        await asyncio.sleep(0.02)


async def test_pulls_a_wanted_snapshot_into_an_empty_store_and_labels_the_node(scene, s3_env):
    publisher = SnapshotStore(scene.tmp_path / "publisher")
    sid = new_snapshot(scene.tmp_path, publisher)
    uri = f"s3://{BUCKET}/{sid[:12]}"
    await publish(publisher, sid, uri)
    scene.controller.body = answer(entry(sid, uri, ("chat",)), entry(ID_B, None, ("local-only",)))

    async with running_agent(scene) as running:
        await until(lambda: snapshot_label(sid) in scene.labels(), "the node's label")
        assert scene.store.ids() == [sid]  # the one with a uri; the other has nowhere to come from
        assert scene.store.remotes(sid) == [uri]
        assert scene.labels() == {**UNRELATED, snapshot_label(sid): "true"}
        assert scene.kube.get("nodes", "", "gpu-node-2")["metadata"]["labels"] == {"team": "other"}
        health = await running.next_sync()
        assert health == {
            "node": NODE,
            "snapshots": [sid],
            "last_sync_at": health["last_sync_at"],
            "last_error": None,
            "pull_failures": {},
        }
        assert abs(health["last_sync_at"] - time.time()) < 60

        assert (await running.get("/metrics")).status_code == 401
        assert (await running.get("/metrics", "wrong-key")).status_code == 401
        metrics = await running.metrics()
        assert "stoker_node_snapshots_held 1.0" in metrics
        assert 'stoker_node_pulls_total{result="ok"} 1.0' in metrics
        assert (
            f"stoker_node_pulled_bytes_total {float(sum(f.size for f in publisher.manifest(sid).files))}"
            in metrics
        )
        assert "stoker_node_last_sync_timestamp_seconds" in metrics
    assert scene.controller.auth_seen == {f"Bearer {ADMIN_KEY}"}


async def test_a_snapshot_removed_from_the_store_loses_its_label_and_other_labels_stay(scene):
    kept, removed = new_snapshot(scene.tmp_path, scene.store), new_snapshot(scene.tmp_path, scene.store)
    stale = snapshot_label("c" * 64)  # a label for a snapshot this store never held: ours, and wrong
    scene.kube.put("nodes", merged(scene, {stale: "true"}), "MODIFIED")
    scene.controller.body = answer()  # the labels follow the store, whatever deployments want

    async with running_agent(scene, warm=False):
        both = {snapshot_label(kept), snapshot_label(removed)}
        await until(lambda: scene.our_labels() == both, "both snapshots' labels, and the stale one gone")
        assert scene.store.remove(removed)
        await until(
            lambda: scene.our_labels() == {snapshot_label(kept)}, "the removed snapshot's label to go"
        )
        assert scene.labels() == {**UNRELATED, snapshot_label(kept): "true"}


def merged(scene: Scene, labels: dict[str, str]) -> dict:
    node = scene.kube.get("nodes", "", NODE)
    return {**node, "metadata": {**node["metadata"], "labels": {**node["metadata"]["labels"], **labels}}}


CONTROLLER_FAULTS = {
    "wrong shape": lambda good: json.dumps({"deployments": [good]}).encode(),
    "path traversal id": lambda good: answer(good, entry("../x", good["uri"])),
    "oversized": lambda good: answer(good, entry(ID_B, None, ["x" * MAX_ANSWER_BYTES])),
    "not json": lambda good: b"<html>502 Bad Gateway</html>",
}


@pytest.mark.parametrize("fault", CONTROLLER_FAULTS.values(), ids=CONTROLLER_FAULTS.keys())
async def test_a_bad_controller_answer_is_refused_and_nothing_is_pulled(scene, s3_env, fault):
    publisher = SnapshotStore(scene.tmp_path / "publisher")
    sid = new_snapshot(scene.tmp_path, publisher)
    uri = f"s3://{BUCKET}/{sid[:12]}"
    await publish(publisher, sid, uri)  # a lax agent would pull the good entry beside the bad one
    held = new_snapshot(scene.tmp_path, scene.store)
    scene.controller.body = fault(entry(sid, uri))

    async with running_agent(scene) as running:
        health = await running.next_sync()
        assert health["last_error"].startswith("controller: ")
        assert scene.store.ids() == [held]
        assert not list(scene.store.root.glob(".*pull*"))  # not even a partial pull
        assert scene.our_labels() == {snapshot_label(held)}  # what it holds is still reported
        assert "stoker_node_pulls_total{" not in await running.metrics()  # no pull, either way


async def test_a_controller_error_status_is_reported_and_the_next_good_answer_is_acted_on(scene, s3_env):
    publisher = SnapshotStore(scene.tmp_path / "publisher")
    sid = new_snapshot(scene.tmp_path, publisher)
    uri = f"s3://{BUCKET}/{sid[:12]}"
    await publish(publisher, sid, uri)
    scene.controller.status = 503

    async with running_agent(scene) as running:
        health = await running.next_sync()
        assert "answered 503" in health["last_error"] and scene.store.ids() == []
        scene.controller.status, scene.controller.body = 200, answer(entry(sid, uri))
        await until(lambda: snapshot_label(sid) in scene.labels(), "the label once the controller answers")


async def test_a_failing_pull_leaves_the_agent_running_and_is_retried(scene, s3_env):
    publisher = SnapshotStore(scene.tmp_path / "publisher")
    sid = new_snapshot(scene.tmp_path, publisher)
    uri = f"s3://{BUCKET}/later-{sid[:12]}"  # nothing there yet: every pull fails
    scene.controller.body = answer(entry(sid, uri))

    async with running_agent(scene) as running:
        registry = running.agent.metrics.registry

        def failed() -> float:
            return registry.get_sample_value("stoker_node_pulls_total", {"result": "failed"}) or 0

        await until(lambda: failed() >= 2, "two failed pulls")
        health = await running.health()  # the agent still answers, and says why the pull fails
        assert health["pull_failures"][sid].startswith(f"pulling {sid[:12]} from {uri}: ")
        assert "next try in" in health["pull_failures"][sid]
        assert scene.store.ids() == [] and scene.our_labels() == set()

        await publish(publisher, sid, uri)
        await until(lambda: snapshot_label(sid) in scene.labels(), "the retried pull's label")
        assert scene.store.ids() == [sid]
        health = await running.next_sync()
        assert (health["last_error"], health["pull_failures"]) == (None, {})
