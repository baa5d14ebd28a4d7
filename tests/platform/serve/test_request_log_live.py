"""The request log, drift and the admin's revision pin on a real `stoker up --request-log` with the
tiny model: what a record holds (and never holds), content logging switched on by a settings
update, the drift API and gauges, `x-stoker-revision` from the admin and from a tenant."""

from __future__ import annotations

import json

import httpx
import pytest

from stoker.gateway.request_log import LOG_DIR, LOG_FILE
from tests.deadlines import COLD_ANSWER, HTTP_READ, deadline

ADMIN = "sk-stoker-admin-for-the-request-log-test"


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_model_dir):
    from tests.platform.conftest import PlatformProcess
    from tests.platform.engine.conftest import free_port

    args = ("--request-log", "--drift-window", "1h", "--drift-min-requests", "2")
    p = PlatformProcess(
        tmp_path_factory.mktemp("rl") / "home", free_port(), args, extra_env={"STOKER_ADMIN_KEY": ADMIN}
    ).start()
    try:
        p.deploy("tiny", tiny_model_dir, "--max", "1", "--idle-timeout", "600")
        p.tiny_model_dir = tiny_model_dir  # the base an adapter's test builds for
        yield p
    finally:
        p.stop()


def records(p) -> list[dict]:
    path = p.home / LOG_DIR / LOG_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def chat(
    p, key: str = ADMIN, content: str = "hello there", headers: dict | None = None, **extra
) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    headers = {"authorization": f"Bearer {key}", **(headers or {})}
    return httpx.post(f"{p.url}/v1/chat/completions", json=body, headers=headers, timeout=COLD_ANSWER)


def admin(p, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(
        method, p.url + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=HTTP_READ
    )


def test_records_hold_the_request_never_its_key_or_content(platform):
    p = platform
    made = json.loads(p.cli("keys", "create", "--tenant", "acme", "--deployment", "tiny", "--json").stdout)
    before = len(records(p))
    first = chat(p, made["key"], content="my password=hunter2222")
    assert first.status_code == 200, first.text
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST",
        f"{p.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=deadline(120),
    ) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    p.wait_for(lambda: len(records(p)) >= before + 2, what="two records")
    plain, streamed = records(p)[before : before + 2]
    assert plain["key_id"] == made["id"] and streamed["key_id"] == "admin"
    assert plain["deployment"] == "tiny" and plain["revision"] == int(first.headers["x-stoker-revision"])
    assert plain["cold_start"] == (first.headers["x-stoker-cold-start"] == "true")
    assert (
        plain["status"] == 200
        and plain["stream"] is False
        and plain["prompt_chars"] == len("my password=hunter2222")
    )
    assert plain["completion_tokens"] == first.json()["usage"]["completion_tokens"]
    assert plain["finish_reason"] == first.json()["choices"][0]["finish_reason"]
    assert (
        plain["ttft_s"] <= plain["e2e_s"]
        and streamed["stream"] is True
        and streamed["completion_tokens"] >= 1
    )
    text = (p.home / LOG_DIR / LOG_FILE).read_text()
    assert (
        made["key"] not in text and ADMIN not in text and "hunter2222" not in text and "prompt" not in plain
    )


def test_content_logging_is_a_deployment_setting_and_masks_secrets(platform, tiny_model_dir):
    p = platform
    bad = admin(
        p,
        "POST",
        "/admin/v1/deployments",
        {"name": "tiny", "model": str(tiny_model_dir), "log_content": "yes"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "log_content"
    updated = admin(p, "POST", "/admin/v1/deployments", {"name": "tiny", "model": str(tiny_model_dir), "max": 1, "idle_timeout_s": 600, "log_content": True})  # fmt: skip
    assert updated.status_code == 200 and updated.json()["deployed"]["settings"]["log_content"] is True
    revision = updated.json()["deployed"]["revision"]
    p.wait_for(
        lambda: chat(p, content="x").headers.get("x-stoker-revision") == str(revision), what="the update"
    )
    before = len(records(p))
    assert chat(p, content="use api_key=abcdef123456 now").status_code == 200

    def this_one() -> list[dict]:
        # A record is written once its answer has gone out, so the poll's last "x" may land after
        # `before` was read: this request's record is the one with its prompt, not the newest.
        return [r for r in records(p)[before:] if "now" in json.dumps(r.get("prompt"))]

    p.wait_for(lambda: this_one(), what="its record")
    [record] = this_one()
    assert record["prompt"] == [{"role": "user", "content": "use api_key=[redacted] now"}]
    assert isinstance(record["answer"], str) and "abcdef123456" not in json.dumps(record)


def test_drift_api_and_gauges(platform):
    p = platform
    for _ in range(2):
        assert chat(p).status_code == 200
    report = admin(p, "GET", "/admin/v1/deployments/tiny/drift").json()
    assert report["current"]["requests"] >= 2 and report["window_s"] == 3600
    pinned = admin(p, "POST", "/admin/v1/deployments/tiny/drift/reference", {"window": "current"})
    assert pinned.status_code == 200 and pinned.json()["reference"]["requests"] >= 2
    assert admin(p, "GET", "/admin/v1/deployments/tiny/drift").json()["reference_pinned"] is True
    none_closed = admin(p, "POST", "/admin/v1/deployments/tiny/drift/reference", {})  # default: last closed
    assert none_closed.status_code == 409 and "no last window" in none_closed.json()["error"]["message"]
    wrong = admin(p, "POST", "/admin/v1/deployments/tiny/drift/reference", {"window": "first"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "window"
    assert admin(p, "GET", "/admin/v1/deployments/nope/drift").status_code == 404
    assert p.metric("stoker_drift_window_requests", deployment="tiny", window="reference") >= 2


def test_the_admin_pins_a_revision_a_tenant_cannot(platform):
    p = platform
    served = chat(p).headers["x-stoker-revision"]
    pinned = chat(p, headers={"x-stoker-revision": served})
    assert pinned.status_code == 200 and pinned.headers["x-stoker-revision"] == served
    for value in ("abc", "0", "99"):
        refused = chat(p, headers={"x-stoker-revision": value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "x-stoker-revision", value
    made = json.loads(p.cli("keys", "create", "--tenant", "t2", "--deployment", "tiny", "--json").stdout)
    ignored = chat(p, made["key"], headers={"x-stoker-revision": "99"})
    assert ignored.status_code == 200 and ignored.headers["x-stoker-revision"] == served


def test_an_adapters_requests_are_recorded_under_its_own_name(platform, tmp_path):
    from tests.conftest import build_tiny_adapter

    p = platform
    lora = tmp_path / "lora"
    build_tiny_adapter(p.tiny_model_dir, lora, seed=3)
    p.cli("deploy", "tiny-lora", "--adapter", str(lora), "--base", "tiny")
    before = len(records(p))
    answer = chat(p, model="tiny-lora")
    assert answer.status_code == 200, answer.text
    p.wait_for(lambda: len(records(p)) > before, what="the adapter's record")
    [record] = [r for r in records(p)[before:] if r["deployment"] == "tiny-lora"]
    assert record["revision"] == int(answer.headers["x-stoker-revision"]) == 1
    assert record["status"] == 200 and record["key_id"] == "admin"
    assert record["completion_tokens"] == answer.json()["usage"]["completion_tokens"]
    assert "hello there" not in json.dumps(record)
