"""The batch API's files in object storage (`stoker up --files-store s3://bucket/prefix`), against a
real moto S3 server behind the counting proxy (which can answer chosen requests with S3 errors),
and a real `stoker up` serving the tiny model, driven by the openai client.

- the bytes of uploads and of a batch's output live in the bucket, described in the data dir;
  a batch reads its input from there and answers each line once; `files.content` streams it back;
  a delete removes the object; the batch has a cost, and its metrics count it;
- a store that keeps failing: an upload is a 503 naming the file and leaves nothing behind; a
  batch whose results cannot be put yet stays `finalizing` and completes once the store answers;
- what a crash leaves half done (metadata journalled `uploading` or `deleting`) is finished at
  the next start, and a copy fetched from the bucket is checked against the recorded sha256.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os

import boto3
import openai
import pytest

from snapshots.errors import RemoteError
from snapshots.s3 import RemoteConfig
from stoker.batch.files import DELETING, UPLOADING, FileStore
from stoker.batch.objects import FileObjects
from tests.deadlines import COLD_ANSWER, deadline
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.platform.gateway.test_keys import ADMIN
from tests.platform.serve.test_batches_live import CHAT, finished, jsonl, line, lines_of
from tests.snapshots.s3_support import MotoServer, Proxy, aws_env

BUCKET, PREFIX = "batchfiles", "stoker"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """moto, the proxy in front of it, the bucket, and the environment that reaches them."""
    tmp = tmp_path_factory.mktemp("s3")
    moto = MotoServer(tmp).start()
    proxy = Proxy(moto.url)
    env = aws_env(dict(os.environ), tmp)
    env["AWS_ENDPOINT_URL"] = proxy.url
    s3 = boto3.client(
        "s3",
        endpoint_url=moto.url,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket=BUCKET)
    try:
        yield env, proxy, s3
    finally:
        proxy.stop()
        moto.kill()


@pytest.fixture(scope="module")
def platform(store, tmp_path_factory, tiny_model_dir):
    env, _, _ = store
    home = tmp_path_factory.mktemp("batches-s3") / "home"
    aws = {k: v for k, v in env.items() if k.startswith("AWS_")}
    args = ("--files-store", f"s3://{BUCKET}/{PREFIX}", "--batch-concurrency", "4")
    p = PlatformProcess(home, free_port(), args, extra_env={"STOKER_ADMIN_KEY": ADMIN, **aws}).start()
    try:
        p.deploy("tiny", tiny_model_dir, "--max", "1", "--idle-timeout", "10m")
        yield p
    finally:
        p.stop()


def client_of(p: PlatformProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.url}/v1", api_key=ADMIN, max_retries=0, timeout=COLD_ANSWER)


def keys(s3) -> set[str]:
    return {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])}


def test_files_and_results_live_in_the_bucket(platform, store):
    s3 = store[2]
    client = client_of(platform)
    n = 12
    data = jsonl([line(i) for i in range(n)])
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    key = f"{PREFIX}/_admin/{uploaded.id}"
    assert key in keys(s3)
    head = s3.head_object(Bucket=BUCKET, Key=key)
    assert head["ContentLength"] == len(data)
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    local = platform.home / "files" / "_admin"
    assert not (local / uploaded.id).exists() and (local / f"{uploaded.id}.json").exists()
    assert client.files.content(uploaded.id).content == data

    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    done = finished(client, batch.id, deadline(300))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    assert f"{PREFIX}/_admin/{done.output_file_id}" in keys(s3)
    assert not (local / done.output_file_id).exists()
    output = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(n))
    work = platform.home / "batches" / "_admin" / batch.id
    assert not (work / "input.jsonl").exists()  # the fetched copy goes with the batch

    # Alone on the deployment, the batch pays for what it spent while it ran.
    assert done.model_extra["cost_usd"] > 0
    assert platform.metric("stoker_batch_cost_usd_total", deployment="tiny") == pytest.approx(
        done.model_extra["cost_usd"], rel=1e-6
    )
    assert platform.metric("stoker_batch_duration_seconds_count", status="completed") >= 1

    assert client.files.delete(uploaded.id).deleted
    assert key not in keys(s3)
    with pytest.raises(openai.NotFoundError):
        client.files.content(uploaded.id)


def test_a_failing_store_refuses_uploads_cleanly_and_holds_results_until_it_answers(platform, store):
    _, proxy, s3 = store
    client = client_of(platform)
    before = {f.id for f in client.files.list()}
    where = f"/{BUCKET}/{PREFIX}/_admin/"
    proxy.fail(where, 50, 503, "SlowDown", method="PUT")  # more than the client's retries
    with pytest.raises(openai.InternalServerError) as refused:
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl([line(0)]))), purpose="batch")
    assert refused.value.status_code == 503
    error = refused.value.body
    assert error["param"] == "file" and error["code"] == "file_store_unavailable"
    assert {f.id for f in client.files.list()} == before
    local = platform.home / "files" / "_admin"
    assert not [p for p in local.iterdir() if p.name.startswith("file-") and not p.name.endswith(".json")]
    proxy.fail(where, 0, 503, "SlowDown")  # the faults left are dropped
    proxy.reset()

    uploaded = client.files.create(
        file=("y.jsonl", io.BytesIO(jsonl([line(i) for i in range(3)]))), purpose="batch"
    )
    proxy.fail(where, 8, 503, "SlowDown", method="PUT")  # the first result PUTs: beyond one try's retries
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    done = finished(client, batch.id, deadline(300))
    assert done.status == "completed", done
    assert done.request_counts.completed == 3
    assert f"{PREFIX}/_admin/{done.output_file_id}" in keys(s3)
    failed = [r for r in proxy.requests() if r["method"] == "PUT" and r["status"] == 503]
    assert len(failed) == 8  # each refused put was tried again, none given up on
    assert len(lines_of(client, done.output_file_id)) == 3


def test_a_crash_half_way_is_finished_and_a_changed_object_is_refused(store, tmp_path, monkeypatch):
    env, proxy, s3 = store
    proxy.reset()
    config = RemoteConfig(endpoint_url=proxy.url, retry_attempts=2, retry_backoff_s=0.01)
    for name, value in env.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)

    async def scenario() -> None:
        objects = FileObjects(f"s3://{BUCKET}/crash", config)
        files = FileStore(tmp_path / "files", 100, objects=objects)
        try:
            kept = await upload(files, b'{"a": 1}\n')
            half_up = await upload(files, b'{"b": 2}\n')
            half_down = await upload(files, b'{"c": 3}\n')
            batch_output = await upload(files, b'{"d": 4}\n')
            # As a crash would leave them: journalled, not finished.
            for file_id, state in ((half_up, UPLOADING), (half_down, DELETING), (batch_output, UPLOADING)):
                meta = tmp_path / "files" / "_admin" / f"{file_id}.json"
                meta.write_text(json.dumps({**json.loads(meta.read_text()), "state": state}))
            (tmp_path / "files" / "_admin" / batch_output).write_bytes(b'{"d": 4}\n')  # its local bytes
            assert files.get("_admin", half_up) is None  # a journal entry is not a file
            # A store that refuses the deletes does not stop the start: the entries wait for the next.
            proxy.fail("/crash/", 20, 503, "SlowDown", method="DELETE")
            assert await files.sweep_objects(keep=[batch_output]) == 1  # the kept one needs no delete
            proxy.fail("/crash/", 0, 503, "SlowDown")
            (tmp_path / "files" / "_admin" / f"{batch_output}.json").write_text(
                json.dumps(
                    {
                        **json.loads((tmp_path / "files" / "_admin" / f"{kept}.json").read_text()),
                        "id": batch_output,
                        "state": UPLOADING,
                    }
                )
            )
            assert await files.sweep_objects(keep=[batch_output]) == 3
            left = {k.rsplit("/", 1)[-1] for k in keys(s3) if k.startswith("crash/")}
            assert left == {kept, batch_output}
            assert [f.id for f in files.list("_admin")] == [kept]
            assert (tmp_path / "files" / "_admin" / batch_output).exists()  # for the batch to publish again

            # The object changed under its metadata: a fetched copy is refused, and not kept.
            s3.put_object(Bucket=BUCKET, Key=f"crash/_admin/{kept}", Body=b'{"a": 2}\n')
            cache = tmp_path / "copy.jsonl"
            with pytest.raises(RemoteError, match="sha256"):
                await files.open("_admin", kept, cache)
            assert not cache.exists()
        finally:
            await objects.close()

    asyncio.run(scenario())


async def upload(files: FileStore, data: bytes) -> str:
    sink = files.begin("_admin", 1 << 20)
    sink.write(data)
    return (await sink.commit("f.jsonl", "batch")).id
