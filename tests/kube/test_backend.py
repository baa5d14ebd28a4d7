"""The Kubernetes backend against the fake API server and kubelet, with the real CPU engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.deadlines import ENGINE_START, HTTP_READ, WAIT, deadline
from tests.kube.conftest import NAMESPACE, Cluster_, TinyStore, kube_config
from tests.snapshots.s3_support import free_port
from warm_pool.backends.base import Placement
from warm_pool.backends.kube import KubeBackend, PodHandle, snapshot_label
from warm_pool.errors import PoolError, StartFailed
from warm_pool.launch import LaunchSpec, cpu_engine_spec

READY_S = ENGINE_START  # an engine pod READY: a loaded 2-core machine imports torch slowly


def placement(store: TinyStore, instance_id: str, secret: str = "", uri: str | None = None) -> Placement:
    return Placement(
        instance_id=instance_id,
        deployment="tiny",
        snapshot_id=store.snapshot_id,
        snapshot_uri=uri,
        engine="cpu",
        gpus=0,
        host="0.0.0.0",
        port=8000,
        secret=secret,
    )


def engine_spec(store: TinyStore, key: str) -> LaunchSpec:
    return cpu_engine_spec(store.snapshot_dir, 8000, "tiny", host="127.0.0.1", threads=1, api_key=key)


def web_spec() -> LaunchSpec:
    """A pod quicker than an engine: python's http.server, ready when it lists its directory."""
    argv = ("/usr/bin/python3", "-m", "http.server", "--bind", "0.0.0.0", "8000")
    return LaunchSpec(
        argv, program="python", program_argc=1, health_path="/", cwd=Path(tempfile.gettempdir())
    )


async def completion(url: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=HTTP_READ) as http:
        return await http.post(f"{url}/v1/completions", json=body, headers=headers)


async def test_a_pod_starts_serves_with_its_secret_and_stops_leaving_nothing(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    key = secrets.token_urlsafe(24)
    backend = cluster.backend(tiny_store.root)
    try:
        handle = await backend.start(
            placement(tiny_store, "tiny-0a1b2c3d", key), engine_spec(tiny_store, key)
        )
        pod = cluster.api.get("pods", NAMESPACE, "tiny-0a1b2c3d")
        assert pod is not None and key not in json.dumps(pod)  # the key only by secretKeyRef
        container = pod["spec"]["containers"][0]
        assert container["command"] == ["stoker"] and container["args"][0] == "engine"
        assert container["args"][container["args"].index("--host") + 1] == "0.0.0.0"
        secret = cluster.api.get("secrets", NAMESPACE, "tiny-0a1b2c3d-key")
        assert secret["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]

        url = await backend.wait_ready(handle, READY_S, health_path="/health")
        assert backend.is_alive(handle)
        async with httpx.AsyncClient(timeout=deadline(30)) as http:
            assert (await http.get(f"{url}/health")).status_code == 200
        assert (await completion(url, None)).status_code == 401
        answer = await completion(url, key)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] is not None

        code = await backend.stop(handle, term_timeout_s=deadline(10))
        assert code == 0
        assert not backend.is_alive(handle)
        assert cluster.api.get("pods", NAMESPACE, "tiny-0a1b2c3d") is None
        assert cluster.api.get("secrets", NAMESPACE, "tiny-0a1b2c3d-key") is None
        assert await backend.stop(handle, term_timeout_s=deadline(10)) is None  # safe to repeat
    finally:
        await backend.aclose()


async def test_a_restarted_controller_adopts_its_pods_and_no_other_owners(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    key = secrets.token_urlsafe(24)
    first, other = cluster.backend(tiny_store.root), cluster.backend(tiny_store.root, owner="ctl-2")
    restarted = cluster.backend(tiny_store.root)
    try:
        handle = await first.start(placement(tiny_store, "tiny-11111111", key), engine_spec(tiny_store, key))
        url = await first.wait_ready(handle, READY_S, health_path="/health")
        strangers = await other.start(placement(tiny_store, "tiny-22222222"), web_spec())
        await other.wait_ready(strangers, READY_S, health_path="/")
        await first.aclose()  # the controller is gone; its pod runs on

        [found] = await restarted.running()
        assert (found.instance_id, found.deployment, found.snapshot_id) == (
            "tiny-11111111",
            "tiny",
            tiny_store.snapshot_id,
        )
        assert (found.url, found.secret, found.handle) == (url, key, handle)
        assert (await completion(found.url, found.secret)).status_code == 200
        assert restarted.is_alive(found.handle)
        assert await restarted.stop(found.handle, term_timeout_s=deadline(10)) == 0
        await other.stop(strangers, term_timeout_s=5)
    finally:
        for backend in (first, other, restarted):
            await backend.aclose()


async def test_a_pod_whose_program_is_missing_fails_its_start_with_the_reason(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    backend = cluster.backend(tiny_store.root)
    spec = LaunchSpec(("/opt/nothing", "serve"), program="no-such-engine", program_argc=1)
    try:
        handle = await backend.start(placement(tiny_store, "tiny-33333333"), spec)
        with pytest.raises(StartFailed) as failed:
            await backend.wait_ready(handle, READY_S, health_path="/health")
        assert "StartError" in str(failed.value) and "executable file not found" in str(failed.value)
        assert failed.value.exit_code == 128 and failed.value.phase == "process_start"
        assert not backend.is_alive(handle)
        await backend.stop(handle, term_timeout_s=5)
        assert cluster.api.get("pods", NAMESPACE, "tiny-33333333") is None
    finally:
        await backend.aclose()


async def test_an_engine_that_exits_fails_its_start_with_its_exit_code_and_log(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    backend = cluster.backend(tiny_store.root)
    spec = cpu_engine_spec(tiny_store.root / "no-such-snapshot", 8000, "tiny", threads=1)
    try:
        handle = await backend.start(placement(tiny_store, "tiny-44444444"), spec)
        with pytest.raises(StartFailed) as failed:
            await backend.wait_ready(handle, READY_S, health_path="/health")
        assert failed.value.exit_code not in (None, 0)
        assert failed.value.log_lines, "the engine's last words are in the failure"
        assert "no-such-snapshot" in str(failed.value)
        await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()


async def test_a_pod_left_pending_by_a_previous_controller_is_deleted_not_adopted(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    for node in list(cluster.api.store.objects):
        if node[0] == "nodes":
            cluster.api.remove(*node)
    first, second = cluster.backend(tiny_store.root), cluster.backend(tiny_store.root)
    try:
        await first.start(placement(tiny_store, "tiny-66666666"), web_spec())  # never scheduled
        assert cluster.api.get("pods", NAMESPACE, "tiny-66666666")["status"]["phase"] == "Pending"
        assert await second.running() == []
        pod = cluster.api.get("pods", NAMESPACE, "tiny-66666666")
        assert pod is None or "deletionTimestamp" in pod["metadata"]
    finally:
        await first.aclose()
        await second.aclose()


async def pending_because(backend: KubeBackend, handle: PodHandle) -> StartFailed:
    """The failure of a short wait for a pod that cannot be scheduled, once the backend has seen why:
    its watch hears the scheduler's verdict just after the pod's creation, which said nothing yet."""
    end = asyncio.get_running_loop().time() + WAIT
    while True:
        with pytest.raises(StartFailed) as failed:
            await backend.wait_ready(handle, 0.2, health_path="/health")
        if "Unschedulable" in str(failed.value) or asyncio.get_running_loop().time() > end:
            return failed.value


async def test_an_unschedulable_pod_times_out_saying_why(cluster: Cluster_, tiny_store: TinyStore) -> None:
    for node in list(cluster.api.store.objects):
        if node[0] == "nodes":
            cluster.api.remove(*node)
    backend = cluster.backend(tiny_store.root)
    try:
        handle = await backend.start(placement(tiny_store, "tiny-55555555"), web_spec())
        failed = await pending_because(backend, handle)
        assert "(Unschedulable: no nodes available to schedule pods)" in str(failed)
        assert failed.phase == "wait_ready"
        await backend.stop(handle, term_timeout_s=5)  # never bound: removed at once
    finally:
        await backend.aclose()


async def test_the_scheduler_prefers_the_node_that_holds_the_snapshot(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    """node-a sorts first and wins a tie; node-b holds the snapshot and wins on affinity."""
    node = cluster.api.get("nodes", "", "node-b")
    node["metadata"]["labels"][snapshot_label(tiny_store.snapshot_id)] = "true"
    backend = cluster.backend(tiny_store.root)
    try:
        acquired = await backend.acquire(Source(tiny_store.snapshot_id), "tiny-66666666")
        assert acquired.path == tiny_store.snapshot_dir and acquired.tier == "disk"
        held = await backend.start(placement(tiny_store, "tiny-66666666"), web_spec())
        other = tiny_store.snapshot_id[::-1]
        elsewhere = await backend.start(placement_for(tiny_store, "tiny-77777777", other), web_spec())
        assert cluster.api.get("pods", NAMESPACE, "tiny-66666666")["spec"]["nodeName"] == "node-b"
        assert cluster.api.get("pods", NAMESPACE, "tiny-77777777")["spec"]["nodeName"] == "node-a"
        assert (await backend.acquire(Source(other), "x")).tier == "object_storage"
        for handle in (held, elsewhere):
            await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()


def placement_for(store: TinyStore, instance_id: str, snapshot_id: str) -> Placement:
    return dataclasses.replace(placement(store, instance_id), snapshot_id=snapshot_id)


class Source:
    """What `acquire` reads of a SnapshotSource: its id (the store is the node's, not ours)."""

    def __init__(self, snapshot_id: str) -> None:
        self.snapshot_id = snapshot_id


async def test_the_watch_lists_again_after_410_gone_and_misses_nothing(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    backend = cluster.backend(tiny_store.root)
    try:
        first = await backend.start(placement(tiny_store, "tiny-88888888"), web_spec())
        lists = backend_lists(cluster)
        cluster.api.compact()
        cluster.api.drop_watches()  # the watch resumes from its version, which is now too old: 410
        second = await backend.start(placement(tiny_store, "tiny-99999999"), web_spec())
        await backend.wait_ready(second, READY_S, health_path="/")  # seen only through the watch
        assert backend_lists(cluster) == lists + 1
        assert backend.is_alive(first) and backend.is_alive(second)
        for handle in (first, second):
            await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()


def backend_lists(cluster: Cluster_) -> int:
    """The backend's lists of pods (the kubelet watches without a label selector)."""
    return sum(
        1 for m, p, q in cluster.api.requests if m == "GET" and "labelSelector" in q and "watch" not in q
    )


async def test_a_handle_names_one_pod_not_a_later_one_with_its_name(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    backend = cluster.backend(tiny_store.root)
    try:
        handle = await backend.start(placement(tiny_store, "tiny-aaaaaaaa"), web_spec())
        stale = PodHandle(handle.namespace, handle.pod, "another-uid")
        assert backend.is_alive(handle) and not backend.is_alive(stale)
        assert await backend.stop(stale, term_timeout_s=5) is None
        assert cluster.api.get("pods", NAMESPACE, "tiny-aaaaaaaa") is not None
        await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()


async def test_an_api_that_does_not_answer_is_a_pool_error_in_time(tiny_store: TinyStore) -> None:
    closed = kube_config(f"http://127.0.0.1:{free_port()}")
    backend = KubeBackend(
        closed,
        NAMESPACE,
        image="i",
        store_path=tiny_store.root,
        owner="ctl-1",
        sync_timeout_s=0.5,
        watch_retry_s=0.1,
    )
    try:
        with pytest.raises(PoolError, match=r"cannot list pods in namespace stoker .*Connect"):
            await backend.start(placement(tiny_store, "tiny-bbbbbbbb"), web_spec())
    finally:
        await backend.aclose()
