"""A deployment whose model is an s3:// snapshot, end to end on a real S3-protocol server (moto).

Deploy reads the snapshot's manifest only; the bytes are pulled when the first instance starts,
pinned while instances use them, and pulled again after the store evicted them.
"""

from __future__ import annotations

import json
import subprocess

import boto3
import httpx
import pytest

from tests.conftest import STOKER
from tests.deadlines import COLD_ANSWER, HTTP_READ, deadline
from tests.snapshots.s3_support import MotoServer, aws_env

BUCKET = "models"
URI = f"s3://{BUCKET}/tiny"


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.kill()


@pytest.fixture
def s3_env(moto, tmp_path, monkeypatch) -> dict[str, str]:
    """The AWS settings the platform (a child process) inherits: moto's endpoint, test credentials."""
    env = {k: v for k, v in aws_env({}, tmp_path).items()}
    env["AWS_ENDPOINT_URL"] = moto.url
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def stoker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([STOKER, *args], env=env, capture_output=True, text=True, timeout=deadline(120))


def publish(tiny_model_dir, tmp_path, env: dict[str, str]) -> str:
    """Import the tiny model into a publisher's own store and push it to the bucket; its id."""
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
    publisher = {**env, "STOKER_HOME": str(tmp_path / "publisher")}
    imported = json.loads(stoker(publisher, "snapshot", "import", str(tiny_model_dir), "--json").stdout)
    pushed = stoker(publisher, "snapshot", "push", imported["id"], URI, "--json")
    assert pushed.returncode == 0, pushed.stderr
    return imported["id"]


def local_snapshots(p) -> dict[str, dict]:
    return {s["id"]: s for s in json.loads(p.cli("snapshot", "ls", "--json").stdout)}


def chat(p) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    r = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=COLD_ANSWER)
    assert r.status_code == 200, r.text
    return r


def test_s3_model_pulls_at_first_start_stays_pinned_and_is_pulled_again_after_eviction(
    platform_factory, tiny_model_dir, tmp_path, s3_env
):
    snapshot_id = publish(tiny_model_dir, tmp_path, s3_env)
    p = platform_factory()
    deployed = p.deploy("tiny", URI, "--idle-timeout", "600")
    assert deployed["snapshot_id"] == snapshot_id
    assert local_snapshots(p) == {}  # deploy read the manifest; nothing is downloaded before a start

    assert chat(p).headers["x-stoker-cold-start"] == "true"
    stored = local_snapshots(p)[snapshot_id]
    assert stored["remotes"] == [URI]
    assert any(holder.startswith("tiny-") for holder in stored["pinned_by"])  # the instance's pin

    # In use: a budget of one byte evicts nothing.
    gc = json.loads(p.cli("snapshot", "gc", "--budget", "1", "--json").stdout)
    assert snapshot_id not in gc["evicted"]
    assert snapshot_id in local_snapshots(p)

    p.cli("rm", "tiny")  # drains and stops the instance: the pin goes with it
    gc = json.loads(p.cli("snapshot", "gc", "--budget", "1", "--json").stdout)
    assert snapshot_id in gc["evicted"]
    assert local_snapshots(p) == {}

    p.deploy("tiny", URI, "--idle-timeout", "600")
    assert chat(p).headers["x-stoker-cold-start"] == "true"  # the start pulled it again
    assert snapshot_id in local_snapshots(p)
    assert "pulled s3://models/tiny" in p.log.read_text()


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ("s3://models/nothing-here", "no snapshot at s3://models/nothing-here"),
        ("s3://no-such-bucket/tiny", "no-such-bucket"),
    ],
)
def test_a_deploy_naming_nothing_in_object_storage_is_a_400_on_model(
    platform_factory, tiny_model_dir, tmp_path, s3_env, model, fragment
):
    boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
    p = platform_factory()
    r = httpx.post(f"{p.url}/admin/v1/deployments", json={"name": "tiny", "model": model}, timeout=HTTP_READ)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model"
    assert fragment in error["message"]
