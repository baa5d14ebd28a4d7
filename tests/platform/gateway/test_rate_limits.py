"""Per-key limits end to end: a real `stoker up`, keys made with the CLI, the official client.

Nothing here races a clock: the request buckets refill once in 100 s and the token bucket once a
minute, so "the next request is refused" holds however slow the machine is; the concurrency cap is
shown with the engine stopped (SIGSTOP), so the requests it holds stay held until the test says.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import httpx
import openai
import pytest

from tests.deadlines import ENGINE_START, WAIT, deadline
from tests.platform.gateway.test_keys import ADMIN, bearer

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def key(p, *flags: str) -> str:
    made = p.cli("keys", "create", "--tenant", "acme", "--deployment", "tiny", *flags, "--json").stdout
    return json.loads(made)["key"]


def post(p, key: str, body: dict = BODY) -> httpx.Response:
    return httpx.post(f"{p.url}/v1/completions", json=body, headers=bearer(key), timeout=deadline(300))


@pytest.fixture
def platform(platform_factory, tiny_model_dir):
    p = platform_factory(
        "--health-interval", "600",  # no probe may eject the engine the last test stops
        "--stream-headers-timeout", "600",
        "--keepalive-interval", "0.05",
        env={"STOKER_ADMIN_KEY": ADMIN},
    )  # fmt: skip
    p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--max", "1", "--idle-timeout", "600")
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, ENGINE_START, "a READY instance")
    return p


def test_requests_and_tokens_over_a_keys_limits_are_429s_with_openai_headers(platform):
    p = platform
    slow = key(p, "--rps", "0.01")
    ok = post(p, slow)
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "1"
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
    over = post(p, slow)
    assert over.status_code == 429
    assert (
        over.json()["error"]["type"] == "requests" and over.json()["error"]["code"] == "rate_limit_exceeded"
    )
    assert 1 < int(over.headers["retry-after"]) <= 100
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=slow, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert post(p, ADMIN).status_code == 200  # the admin's key is not limited

    thrifty = key(p, "--tpm", "1")  # one token a minute: the first request empties it for minutes
    first = post(p, thrifty)
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-tokens"] == "1"
    over = post(p, thrifty)
    assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
    assert int(over.headers["retry-after"]) > 60  # it is charged what it used: several tokens
    assert over.headers["x-ratelimit-remaining-tokens"] == "0"

    listed = {k["tenant"]: k for k in json.loads(p.cli("keys", "ls", "--json").stdout)}
    assert listed["acme"]["rps"] is not None or listed["acme"]["tpm"] is not None
    assert "0.01 rps" in p.cli("keys", "ls").stdout and "1 tpm" in p.cli("keys", "ls").stdout


def test_a_key_holding_its_cap_is_refused_while_others_are_not(platform):
    p = platform
    capped = key(p, "--max-concurrent", "1")
    (pid,) = p.engine_pids().values()
    os.kill(pid, signal.SIGSTOP)
    pool = concurrent.futures.ThreadPoolExecutor(12)
    try:
        # The admin fills the instance's 8 slots and one more waits: from here on, anything held stays held.
        admin = [pool.submit(post, p, ADMIN) for _ in range(9)]
        p.wait_for(lambda: p.metric("stoker_queue_length", deployment="tiny") == 1, WAIT, "a held request")
        held = pool.submit(held_stream, p, capped)
        p.wait_for(
            lambda: p.metric("stoker_queue_length", deployment="tiny") == 2, 60, "the key's request held"
        )
        over = post(p, capped)
        assert over.status_code == 429 and over.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert over.headers["retry-after"] == "1"
        other = pool.submit(post, p, key(p))  # another key of the same tenant has its own cap
        p.wait_for(
            lambda: p.metric("stoker_queue_length", deployment="tiny") == 3, WAIT, "the other key held"
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [f.result(timeout=deadline(300)).status_code for f in admin] == [200] * 9
    assert held.result(timeout=deadline(300)).endswith("data: [DONE]")
    assert other.result(timeout=deadline(300)).status_code == 200
    assert post(p, capped).status_code == 200  # its place came back when its request finished
    pool.shutdown()


def held_stream(p, key: str) -> str:
    body = {**BODY, "stream": True}
    with httpx.stream(
        "POST", f"{p.url}/v1/completions", json=body, headers=bearer(key), timeout=deadline(300)
    ) as r:
        assert r.status_code == 200
        return "\n".join(line for line in r.iter_lines() if line.startswith("data:"))
