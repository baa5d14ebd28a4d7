"""The batch API against a real `stoker up` serving the tiny model on the CPU engine, driven by the
official openai client as its users drive it: `files.create(purpose="batch")`, `batches.create`,
polling `batches.retrieve`, `files.content` of the output and error files.

Also: a tenant sees only its own files and batches; bad lines end in the error file, each once;
and a `stoker up` killed (SIGKILL) in the middle of a batch and restarted on the same data dir
finishes it with every input line answered exactly once.
"""

from __future__ import annotations

import io
import json
import signal
import time

import httpx
import openai
import pytest

from tests.deadlines import COLD_ANSWER, ENGINE_START, deadline
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.platform.gateway.test_keys import ADMIN

CHAT = "/v1/chat/completions"


def line(i: int, model: str = "tiny", **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2, "seed": i}
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": body, **extra}


def jsonl(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def finished(client: openai.OpenAI, batch_id: str, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout:g} s: {batch}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("batches") / "home"
    p = PlatformProcess(
        home, free_port(), ("--batch-concurrency", "4"), extra_env={"STOKER_ADMIN_KEY": ADMIN}
    ).start()
    try:
        p.deploy("tiny", tiny_model_dir, "--max", "1", "--idle-timeout", "10m")
        keys = {}
        for tenant in ("alpha", "beta"):
            made = p.cli("keys", "create", "--tenant", tenant, "--deployment", "tiny", "--json").stdout
            keys[tenant] = json.loads(made)["key"]
        p.keys = keys
        yield p
    finally:
        p.stop()


def client_of(p: PlatformProcess, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.url}/v1", api_key=p.keys[tenant], max_retries=0, timeout=COLD_ANSWER)


def test_a_batch_of_200_round_trips_through_the_openai_client(platform):
    client = client_of(platform, "alpha")
    bad = [
        b"this is not json",
        line(900, method="GET"),
        line(901, url="/v1/completions"),
        {"custom_id": "req-902", "method": "POST", "url": CHAT, "body": {"messages": []}},
        line(0),  # custom_id req-0 again
        line(903, model="nope"),  # valid, but no such model: answered 404 by the gateway
    ]
    rows = [line(i) for i in range(200)] + bad
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(rows))
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"}
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = finished(client, batch.id, deadline(600))
    assert done.status == "completed", done
    assert done.request_counts.total == 206
    assert (done.request_counts.completed, done.request_counts.failed) == (200, 6)
    assert done.usage.output_tokens >= 200 and done.usage.input_tokens > 0

    output = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(200))
    for o in output:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["body"]["object"] == "chat.completion"
    errors = lines_of(client, done.error_file_id)
    assert len(errors) == 6
    by_line = {e["error"]["line"]: e for e in errors if e["error"] is not None}
    assert set(by_line) == {201, 202, 203, 204, 205}
    assert by_line[205]["custom_id"] == "req-0" and by_line[205]["error"]["code"] == "duplicate_custom_id"
    missing = [e for e in errors if e["custom_id"] == "req-903"]
    assert missing[0]["response"]["status_code"] == 404

    with pytest.raises(openai.ConflictError):  # a completed batch cannot be cancelled
        client.batches.cancel(batch.id)
    assert [b.id for b in client.batches.list()] == [batch.id]
    kinds = {f.id: f.purpose for f in client.files.list()}
    assert kinds == {
        uploaded.id: "batch",
        done.output_file_id: "batch_output",
        done.error_file_id: "batch_output",
    }
    assert platform.metric("stoker_batch_requests_total", deployment="tiny", outcome="completed") == 200


def test_a_tenant_sees_only_its_own_files_and_batches(platform):
    alpha, beta = client_of(platform, "alpha"), client_of(platform, "beta")
    mine = alpha.files.create(file=("a.jsonl", io.BytesIO(jsonl([line(1)]))), purpose="batch")
    assert mine.id not in {f.id for f in beta.files.list()}
    with pytest.raises(openai.NotFoundError):
        beta.files.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        beta.files.content(mine.id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.create(input_file_id=mine.id, endpoint=CHAT, completion_window="24h")
    batch = alpha.batches.create(input_file_id=mine.id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        beta.batches.retrieve(batch.id)
    assert finished(alpha, batch.id, deadline(120)).status == "completed"
    assert alpha.files.delete(mine.id).deleted
    with pytest.raises(openai.NotFoundError):
        alpha.files.retrieve(mine.id)


def test_a_cancelled_batch_still_answers_every_line_once(platform):
    # A key allowed one request now and then: its lines wait out 429s, retried over half a
    # minute, so the cancel finds the batch in progress.
    made = platform.cli(
        "keys", "create", "--tenant", "slow", "--deployment", "tiny", "--rps", "0.001", "--json"
    ).stdout
    platform.keys["slow"] = json.loads(made)["key"]
    client = client_of(platform, "slow")
    n = 10
    rows = jsonl([line(i) for i in range(n)])
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = finished(client, batch.id, deadline(120))
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.total == n and counts.completed + counts.failed == n
    answered = lines_of(client, done.output_file_id) + lines_of(client, done.error_file_id)
    assert sorted(a["custom_id"] for a in answered) == sorted(f"req-{i}" for i in range(n))
    statuses = {a["response"]["status_code"] for a in answered if a["response"]}
    assert statuses <= {200, 429}
    assert {a["error"]["code"] for a in answered if a["error"]} <= {"batch_cancelled"}


def test_refusals_name_the_field(platform):
    headers = {"authorization": f"Bearer {platform.keys['alpha']}"}
    url = platform.url
    r = httpx.post(
        f"{url}/v1/files", headers=headers, files={"file": ("x", b"{}")}, data={"purpose": "fine-tune"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = httpx.post(f"{url}/v1/files", headers=headers, json={"purpose": "batch"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "file"
    for body, param in (
        ({"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
        ({"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/x", "completion_window": "24h"}, "endpoint"),
        (
            {"input_file_id": "file-" + "0" * 24, "endpoint": CHAT, "completion_window": "1s"},
            "completion_window",
        ),
        (
            {"input_file_id": "file-" + "0" * 24, "endpoint": CHAT, "completion_window": "24h"},
            "input_file_id",
        ),
    ):
        r = httpx.post(f"{url}/v1/batches", headers=headers, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{url}/v1/batches").status_code == 401
    assert (
        httpx.get(f"{url}/v1/files", headers=headers, params={"limit": "0"}).json()["error"]["param"]
        == "limit"
    )


def test_a_platform_killed_mid_batch_finishes_it_each_line_once(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    # One line at a time, so that the kill lands with most of the batch still to run.
    args = ("--batch-concurrency", "1")
    p = PlatformProcess(home, free_port(), args, extra_env={"STOKER_ADMIN_KEY": ADMIN}).start()
    try:
        p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--max", "1", "--idle-timeout", "10m")
        p.wait_for(
            lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, ENGINE_START, "a READY instance"
        )
        client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=ADMIN, max_retries=0, timeout=COLD_ANSWER)
        n = 120
        uploaded = client.files.create(
            file=("in.jsonl", io.BytesIO(jsonl([line(i) for i in range(n)]))), purpose="batch"
        )
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        p.wait_for(
            lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5,
            deadline(120),
            "5 lines answered",
        )
        before = client.batches.retrieve(batch.id).request_counts.completed
        p.stop(signal.SIGKILL)
        assert client_gone(p) and before < n  # killed with lines still to run

        p.port = free_port()
        p.start()
        client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=ADMIN, max_retries=0, timeout=COLD_ANSWER)
        done = finished(client, batch.id, deadline(600))
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            n,
            n,
            0,
        )
        ids = [o["custom_id"] for o in lines_of(client, done.output_file_id)]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(n))  # each exactly once
        assert done.error_file_id is None
    finally:
        p.stop()


def client_gone(p: PlatformProcess) -> bool:
    return p.proc.poll() is not None
