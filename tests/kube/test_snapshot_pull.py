"""A pod on a node whose store lacks the snapshot: its init container pulls it from object storage
(moto, a real S3-protocol server) into the node's store, with credentials from a Secret."""

from __future__ import annotations

import base64
import json
import secrets
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from lightkube.resources.core_v1 import Secret

from tests.conftest import STOKER
from tests.deadlines import deadline
from tests.kube.conftest import NAMESPACE, Cluster_
from tests.kube.test_backend import READY_S, Source, completion
from tests.snapshots.s3_support import ACCESS_KEY, SECRET_KEY, MotoServer, aws_env
from warm_pool.backends.base import Placement
from warm_pool.errors import StartFailed
from warm_pool.launch import cpu_engine_spec

URI = "s3://models/tiny"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def published(moto: MotoServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model pushed to the bucket from a publisher's own store; its snapshot id."""
    tmp = tmp_path_factory.mktemp("publisher")
    env = {**aws_env({"PATH": "/usr/bin:/bin"}, tmp), "AWS_ENDPOINT_URL": moto.url, "STOKER_HOME": str(tmp)}
    boto3.client(
        "s3",
        endpoint_url=moto.url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    ).create_bucket(Bucket="models")
    imported = subprocess.run(
        [STOKER, "snapshot", "import", str(tiny_model_dir), "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    snapshot_id = json.loads(imported.stdout)["id"]
    subprocess.run([STOKER, "snapshot", "push", snapshot_id, URI], env=env, capture_output=True, check=True)
    return snapshot_id


async def credentials(cluster: Cluster_) -> str:
    data = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    secret = Secret.from_dict(
        {
            "metadata": {"name": "s3-credentials"},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }
    )
    await cluster.client.create(secret, namespace=NAMESPACE)
    return "s3-credentials"


def pull_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def placement(instance_id: str, snapshot_id: str, key: str = "") -> Placement:
    return Placement(instance_id, "tiny", snapshot_id, URI, "cpu", 0, "0.0.0.0", 8000, key)


async def test_the_init_container_pulls_the_snapshot_onto_the_node_then_the_engine_serves_it(
    cluster: Cluster_, moto: MotoServer, published: str, tmp_path: Path
) -> None:
    node_store = tmp_path / "node-store"
    node_store.mkdir()
    key = secrets.token_urlsafe(24)
    backend = cluster.backend(node_store, pull_env=pull_env(moto.url), pull_secret=await credentials(cluster))
    try:
        acquired = await backend.acquire(Source(published), "tiny-0f0f0f0f")
        spec = cpu_engine_spec(acquired.path, 8000, "tiny", threads=1, api_key=key)
        handle = await backend.start(placement("tiny-0f0f0f0f", published, key), spec)
        url = await backend.wait_ready(handle, READY_S, health_path="/health")
        assert (node_store / published / "config.json").is_file()
        assert (await completion(url, key)).status_code == 200
        await backend.stop(handle, term_timeout_s=deadline(10))
    finally:
        await backend.aclose()


async def test_a_pull_that_fails_fails_the_start_in_the_snapshot_phase(
    cluster: Cluster_, published: str, tmp_path: Path
) -> None:
    nowhere = f"http://127.0.0.1:{_closed_port()}"
    backend = cluster.backend(tmp_path, pull_env=pull_env(nowhere), pull_secret=await credentials(cluster))
    spec = cpu_engine_spec(tmp_path / published, 8000, "tiny", threads=1)
    try:
        handle = await backend.start(placement("tiny-0e0e0e0e", published), spec)
        with pytest.raises(StartFailed) as failed:
            await backend.wait_ready(handle, READY_S, health_path="/health")
        assert failed.value.phase == "snapshot" and failed.value.exit_code not in (None, 0)
        assert "cannot reach" in str(failed.value)  # the init container's own log
        await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_engine_that_crashes_after_a_good_pull_is_blamed_not_the_pull(
    cluster: Cluster_, moto: MotoServer, published: str, tmp_path: Path
) -> None:
    """The init container Completed with 0 (and the kubelet keeps saying so); the engine then exits
    on a snapshot path that is not there: its own exit code, phase and log are the failure."""
    node_store = tmp_path / "node-store"
    node_store.mkdir()
    backend = cluster.backend(node_store, pull_env=pull_env(moto.url), pull_secret=await credentials(cluster))
    spec = cpu_engine_spec(node_store / "no-such-snapshot", 8000, "tiny", threads=1)
    try:
        handle = await backend.start(placement("tiny-0d0d0d0d", published), spec)
        with pytest.raises(StartFailed) as failed:
            await backend.wait_ready(handle, READY_S, health_path="/health")
        pod = cluster.api.get("pods", NAMESPACE, "tiny-0d0d0d0d")
        [pulled] = pod["status"]["initContainerStatuses"]
        assert pulled["name"] == "snapshot-pull"
        assert (
            pulled["state"]["terminated"]["exitCode"] == 0
            and pulled["state"]["terminated"]["reason"] == "Completed"
        )
        [engine] = pod["status"]["containerStatuses"]
        code = engine["state"]["terminated"]["exitCode"]
        assert code != 0 and failed.value.exit_code == code
        assert failed.value.phase == "process_start"
        assert f"container engine exited with status {code} (Error)" in str(failed.value)
        assert "snapshot-pull" not in str(failed.value)
        assert "no-such-snapshot" in " ".join(failed.value.log_lines)  # the engine's log, not the pull's
        assert (node_store / published / "config.json").is_file()  # the pull did its part
        await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()
