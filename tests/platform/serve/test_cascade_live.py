"""Cascade routes on a real platform (`stoker up`, the CPU engine, tiny random models on loopback):
two deployments, `small` (a 64-token context) and `big`, and routes over them made with the CLI.

One platform for the module (files go whole to one xdist worker, so the tests run in this order;
the first one's requests start both deployments' instances). No timing asserts: the random models'
mean token logprob is about -6, so a threshold of -100 keeps every answer small and 0 escalates
every one.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import build_tiny_model
from tests.deadlines import COLD_ANSWER, HTTP_READ, deadline
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.snapshots.support import assert_one_line_error

ADMIN = "admin-secret-for-cascade-tests"
AUTH = {"authorization": f"Bearer {ADMIN}"}
# ~300 bytes the tiny tokenizer never saw: far more than 64 tokens, yet under the gateway's cheap
# estimate (bytes / 8 ≈ 37), so the small deployment is asked and answers its context-length 400.
TOO_LONG = "zqxj vkw " * 33
# So long the estimate alone (891 / 8 tokens) says it cannot fit: the small one is not asked (and
# short enough for big's 2048).
FAR_TOO_LONG = TOO_LONG * 3


@pytest.fixture(scope="module")
def p(tmp_path_factory, tiny_model_dir):
    small_model = build_tiny_model(tmp_path_factory.mktemp("small-model") / "small-llama", max_positions=64)
    proc = PlatformProcess(
        tmp_path_factory.mktemp("cascade") / "home",
        free_port(),
        ("--stable-window", "600"),
        extra_env={"STOKER_ADMIN_KEY": ADMIN},
    ).start()
    try:
        # Through the admin API, not the CLI (a process each): the CLI has its own test below. One
        # instance each from the start, so that both start at once.
        for name, model in (("small", small_model), ("big", tiny_model_dir)):
            deploy = {"name": name, "model": str(model), "min_warm": 1, "idle_timeout_s": 600}
            assert admin(proc, "POST", "/admin/v1/deployments", deploy).status_code == 201
        for name, threshold in (("assist", -100), ("strict", 0)):
            route = {"name": name, "small": "small", "large": "big", "min_mean_logprob": threshold}
            assert admin(proc, "POST", "/admin/v1/routes", route).status_code == 201
        yield proc
    finally:
        proc.stop()


def admin(p, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, p.url + path, json=body, headers=AUTH, timeout=HTTP_READ)


def chat(p, model: str, content: str = "Hello", key: str = ADMIN, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return httpx.post(
        f"{p.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=COLD_ANSWER,
    )


def test_a_sure_answer_stays_on_small_and_an_unsure_one_escalates(p):
    sure = chat(p, "assist", temperature=0)
    assert sure.status_code == 200, sure.text
    assert sure.headers["x-stoker-cascade"] == "small"
    assert float(sure.headers["x-stoker-cascade-logprob"]) < 0
    answer = sure.json()
    assert answer["model"] == "small" and answer["choices"][0]["logprobs"] is None  # added, taken out

    unsure = chat(p, "strict", logprobs=True)  # asked for: they stay
    assert unsure.status_code == 200, unsure.text
    assert unsure.headers["x-stoker-cascade"] == "escalated-unsure"
    assert unsure.json()["model"] == "big" and unsure.json()["choices"][0]["logprobs"]["content"]

    legacy = httpx.post(
        f"{p.url}/v1/completions",
        json={"model": "strict", "prompt": "Hello", "max_tokens": 3},
        headers=AUTH,
        timeout=deadline(120),
    )
    assert legacy.headers["x-stoker-cascade"] == "escalated-unsure" and legacy.json()["model"] == "big"
    assert p.metric("stoker_cascade_requests_total", route="assist", outcome="small") == 1
    assert p.metric("stoker_cascade_requests_total", route="strict", outcome="escalated_unsure") == 2
    assert p.metric("stoker_cascade_latency_seconds_count", route="strict", side="small") == 2
    assert p.metric("stoker_cascade_latency_seconds_count", route="strict", side="large") == 2
    # The small one's time on escalated requests is counted lost; savings appear once the large
    # side has answered for the route (strict has, assist has not).
    assert p.metric("stoker_cascade_lost_seconds_total", route="strict") > 0


def test_a_prompt_too_long_for_small_escalates_for_context(p):
    refused_before = p.metric("stoker_requests_total", deployment="small", code="400")
    asked = chat(p, "assist", TOO_LONG)
    assert asked.status_code == 200, asked.text
    assert (asked.headers["x-stoker-cascade"], asked.json()["model"]) == ("escalated-context", "big")
    assert p.metric("stoker_requests_total", deployment="small", code="400") == refused_before + 1

    estimated = chat(p, "assist", FAR_TOO_LONG)
    assert (estimated.headers["x-stoker-cascade"], estimated.json()["model"]) == ("escalated-context", "big")
    assert (
        p.metric("stoker_requests_total", deployment="small", code="400") == refused_before + 1
    )  # not asked
    assert p.metric("stoker_cascade_requests_total", route="assist", outcome="escalated_context") == 2

    direct = chat(p, "small", TOO_LONG)  # the deployment itself still refuses it
    assert direct.status_code == 400 and direct.json()["error"]["code"] == "context_length_exceeded"


def _stream(p, model: str, content: str) -> tuple[httpx.Headers, list[str]]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{p.url}/v1/chat/completions", json=body, headers=AUTH, timeout=COLD_ANSWER
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
        return r.headers, lines


def test_streams_escalate_only_before_their_first_byte(p):
    headers, lines = _stream(p, "strict", "Hello")  # not judged: a stream goes out as it comes
    assert headers["x-stoker-cascade"] == "small" and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["model"] == "small"

    headers, lines = _stream(p, "assist", TOO_LONG)  # the small one's 400 comes before any byte
    assert headers["x-stoker-cascade"] == "escalated-context" and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["model"] == "big"


def test_routes_admin_api_and_cli(p):
    listed = {r["name"]: r for r in json.loads(p.cli("routes", "ls", "--json").stdout)}
    assert listed["assist"]["small"] == "small" and listed["assist"]["min_mean_logprob"] == -100
    assert listed["strict"]["requests"]["escalated_unsure"] >= 2
    text = p.cli("routes", "ls").stdout
    assert "assist" in text and "escalated" in text

    def post(body):
        return admin(p, "POST", "/admin/v1/routes", body)

    for body, status, param in [
        ({"name": "x", "small": "small"}, 400, "large"),
        ({"name": "x", "small": "small", "large": "nope"}, 400, "large"),
        ({"name": "x", "small": "small", "large": "big", "min_mean_logprob": 1}, 400, "min_mean_logprob"),
        ({"name": "x", "small": "small", "large": "big", "extra": 1}, 400, "extra"),
        ({"name": "big", "small": "small", "large": "nope"}, 409, "name"),  # a deployment's name
        ({"name": "other", "small": "small", "large": "small"}, 400, "large"),
    ]:
        answer = post(body)
        assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), answer.text
    taken = post({"name": "small", "small": "big", "large": "nope"})  # clients send both as `model`
    assert (taken.status_code, taken.json()["error"]["code"]) == (409, "name_taken")

    assert httpx.get(f"{p.url}/admin/v1/routes/nope", headers=AUTH).status_code == 404
    assert httpx.delete(f"{p.url}/admin/v1/routes/nope", headers=AUTH).status_code == 404
    made = json.loads(
        p.cli("routes", "create", "temp", "--small", "small", "--large", "big", "--json").stdout
    )
    assert (made["min_mean_logprob"], made["escalate_on_context"]) == (-1.0, True)
    assert post({"name": "temp", "small": "small", "large": "big", "min_mean_logprob": -2}).status_code == 200
    assert httpx.get(f"{p.url}/admin/v1/routes/temp", headers=AUTH).json()["min_mean_logprob"] == -2
    assert p.cli("routes", "rm", "temp").stdout.strip() == "removed route temp"
    assert httpx.get(f"{p.url}/admin/v1/routes/temp", headers=AUTH).status_code == 404

    assert_one_line_error(p.cli("routes", "create", "y", "--small", "small", "--large", "nope", check=False), "'large': no deployment named 'nope'")  # fmt: skip
    assert_one_line_error(p.cli("routes", "create", "y", "--small", "a", "--large", "b", "--min-logprob", "1", check=False), "argument --min-logprob: must be a number in -9999..0")  # fmt: skip
    assert_one_line_error(p.cli("routes", "rm", "nope", check=False), "No route named 'nope'")
    assert "$STOKER_URL" in p.cli("routes", "create", "--help").stdout


def test_a_tenant_key_calls_a_route_only_with_the_route_and_both_deployments(p):
    def key(*deployments: str) -> str:
        return admin(
            p, "POST", "/admin/v1/keys", {"tenant": "acme", "deployments": list(deployments)}
        ).json()["key"]

    allowed = key("assist", "small", "big")
    assert chat(p, "assist", key=allowed).headers["x-stoker-cascade"] == "small"
    missing = chat(p, "nope", key=allowed).json()["error"]
    for narrow in (key("assist"), key("assist", "small"), key("small", "big")):
        answer = chat(p, "assist", key=narrow)
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["code"] == missing["code"] == "model_not_found"  # no existence leak
        assert error["message"].replace("assist", "X") == missing["message"].replace("nope", "X")
    openai_client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=allowed, max_retries=0)
    reply = openai_client.chat.completions.create(
        model="assist", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.model == "small"
    # Routes are the admin's: a tenant key cannot list or make them.
    assert (
        httpx.get(f"{p.url}/admin/v1/routes", headers={"authorization": f"Bearer {allowed}"}).status_code
        == 401
    )
