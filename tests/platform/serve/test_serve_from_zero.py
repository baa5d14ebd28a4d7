"""Scale from zero end to end: the real `stoker up`, real engine processes, the official client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import httpx
import openai
import pytest

from tests.deadlines import COLD_ANSWER, HTTP_READ, deadline
from tests.platform.conftest import pid_alive

CHAT = [{"role": "user", "content": "Hello there"}]


def client(p) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0, timeout=COLD_ANSWER)


def test_request_at_zero_is_held_then_answered_whole_and_streamed(platform_factory, tiny_model_dir):
    # The default stable window (60 s): the warm request must find the instance READY, not asleep.
    # At 2 s, a test process the loaded machine kept from sending it for 2 s after the first
    # answer met an instance the policy had, rightly, put to sleep (its wake is a cold start).
    p = platform_factory()
    p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
    assert p.deployments()["tiny"]["instances"]["READY"] == 0

    raw = client(p).chat.completions.with_raw_response.create(model="tiny", messages=CHAT, max_tokens=5)
    assert raw.headers["x-stoker-cold-start"] == "true"
    assert raw.headers["x-stoker-instance"].startswith("tiny-")
    answer = raw.parse()
    assert answer.choices[0].finish_reason in ("stop", "length")

    warm = client(p).chat.completions.with_raw_response.create(model="tiny", messages=CHAT, max_tokens=5)
    assert warm.headers["x-stoker-cold-start"] == "false"
    assert warm.headers["x-stoker-instance"] == raw.headers["x-stoker-instance"]

    chunks = list(client(p).chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client(p).models.list().data] == ["tiny"]


def test_a_stream_at_zero_gets_keepalives_then_tokens(platform_factory, tiny_model_dir):
    # Keep-alives every 50 ms: an engine process takes far longer than that to start (importing
    # torch alone does), so the body begins with one however fast this machine starts one.
    p = platform_factory("--keepalive-interval", "0.05")
    p.deploy("tiny", tiny_model_dir)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{p.url}/v1/completions", json=body, timeout=COLD_ANSWER) as r:
        assert r.status_code == 200
        assert r.headers["x-stoker-cold-start"] == "true"
        raw = b"".join(r.iter_raw())
    assert raw.startswith(b"\n\n")  # a keep-alive is a blank line pair (activator.proxy.KEEPALIVE)
    lines = [line for line in raw.decode().splitlines() if line]
    data = [line for line in lines if line.startswith("data:")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


async def test_twenty_concurrent_requests_at_zero_share_one_cold_start(platform_factory, tiny_model_dir):
    p = platform_factory()
    p.deploy("tiny", tiny_model_dir, "--max", "1")
    aclient = openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0, timeout=COLD_ANSWER)
    results = await asyncio.gather(
        *(aclient.completions.create(model="tiny", prompt=f"n{i}", max_tokens=3) for i in range(20))
    )
    await aclient.close()
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert p.metric("stoker_instance_starts_total", deployment="tiny", outcome="ready") == 1
    assert p.metric("stoker_requests_total", deployment="tiny", code="200") == 20


def test_scales_to_zero_after_the_idle_timeout(platform_factory, tiny_model_dir):
    p = platform_factory("--stable-window", "1")
    p.deploy("tiny", tiny_model_dir, "--idle-timeout", "2")
    client(p).completions.create(model="tiny", prompt="x", max_tokens=2)
    pids = p.engine_pids()
    assert len(pids) == 1
    p.wait_for(
        lambda: p.deployments()["tiny"]["instances"]["READY"] == 0, timeout=deadline(30), what="scale to zero"
    )
    p.wait_for(lambda: not p.engine_pids(), timeout=deadline(30), what="instance stopped")
    assert not any(pid_alive(pid) for pid in pids.values())
    assert p.metric("stoker_instance_seconds_total", deployment="tiny", state="READY") > 0


def test_removing_a_deployment_drains_the_stream_in_flight(platform_factory, tiny_model_dir):
    p = platform_factory()
    p.deploy("tiny", tiny_model_dir, "--grace-period", "60")
    client(p).completions.create(model="tiny", prompt="warm up", max_tokens=1)
    body = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{p.url}/v1/completions", json=body, timeout=COLD_ANSWER) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        removal = threading.Thread(target=p.cli, args=("rm", "tiny"))
        removal.start()  # scale-down begins while the stream is in flight
        p.wait_for(lambda: p.deployments()["tiny"]["instances"]["DRAINING"] == 1, what="draining")
        rest = [line for line in lines if line.startswith("data:")]
    removal.join(timeout=deadline(90))
    events = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]"
    assert all("error" not in e for e in events)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 300  # every token of the stream arrived
    assert "tiny" not in p.deployments()
    assert not p.engine_pids()


def test_queue_full_and_hold_deadline_answer_503_with_retry_after(platform_factory, tiny_model_dir):
    # A fixed 2 s hold: --hold-deadline-max too, or the hold would follow the engine's expected
    # start (its prior, 7.7 s, times 1.5) and the held request would be served.
    p = platform_factory("--max-queued", "1", "--hold-deadline", "2", "--hold-deadline-max", "2")
    p.deploy("tiny", tiny_model_dir)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}

    async def two_at_zero():
        async with httpx.AsyncClient(timeout=deadline(30)) as c:
            return await asyncio.gather(*(c.post(f"{p.url}/v1/completions", json=body) for _ in range(2)))

    first, second = sorted(asyncio.run(two_at_zero()), key=lambda r: r.json()["error"]["code"])
    # One was held and waited 2 s for an engine that takes longer to start; the other found the
    # one-place queue full at once.
    assert first.json()["error"]["code"] == "hold_deadline"
    assert second.json()["error"]["code"] == "queue_full"
    for r in (first, second):
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, what="the instance")
    assert httpx.post(f"{p.url}/v1/completions", json=body, timeout=HTTP_READ).status_code == 200


def test_a_killed_instance_is_routed_around_and_replaced(platform_factory, tiny_model_dir):
    p = platform_factory()
    p.deploy("tiny", tiny_model_dir, "--min-warm", "2", "--max", "2")
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 2, what="two READY instances")
    pids = p.engine_pids()
    victim, victim_pid = next(iter(pids.items()))
    os.kill(victim_pid, signal.SIGKILL)
    served = set()
    for _ in range(4):  # round-robin ties: the dead instance is picked before the pool notices
        r = httpx.post(
            f"{p.url}/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            timeout=HTTP_READ,
        )
        assert r.status_code == 200, r.text
        served.add(r.headers["x-stoker-instance"])
    assert victim not in served
    p.wait_for(
        lambda: p.deployments()["tiny"]["instances"]["READY"] == 2 and victim not in p.engine_pids(),
        what="a replacement instance",
    )
    assert p.metric("stoker_instance_restarts_total", deployment="tiny") >= 1


def test_restart_brings_deployments_back_adopts_what_a_crash_left_and_leaves_no_engine(
    platform_factory, tiny_model_dir, tmp_path
):
    home = tmp_path / "home"
    p = platform_factory(home=home)
    p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--max", "1")
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, what="READY")
    pids = list(p.engine_pids().values())
    assert p.stop() == 0
    assert pids and not any(pid_alive(pid) for pid in pids)  # checked by PID, not by name

    again = platform_factory(home=home)
    assert again.deployments()["tiny"]["min_warm"] == 1
    r = httpx.post(
        f"{again.url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        timeout=HTTP_READ,
    )
    assert r.status_code == 200

    # A platform killed outright leaves its engine behind; the next one adopts it (same process),
    # and, stopped cleanly, leaves none.
    left = list(again.engine_pids().values())
    again.stop(signal.SIGKILL)
    assert left and all(pid_alive(pid) for pid in left)
    third = platform_factory(home=home)
    third.wait_for(lambda: third.deployments()["tiny"]["instances"]["READY"] == 1, what="adopted")
    assert list(third.engine_pids().values()) == left
    assert third.stop() == 0
    assert not any(pid_alive(pid) for pid in left)


def test_unknown_model_is_a_404_in_openai_shape(shared_platform):
    with pytest.raises(openai.NotFoundError) as info:
        client(shared_platform).completions.create(model="nope", prompt="x")
    assert info.value.body["code"] == "model_not_found"


def test_gateway_bad_bodies(shared_platform):
    url = f"{shared_platform.url}/v1/completions"
    for content, param in [
        (b"{", None),
        (b"[]", None),
        (b'{"prompt": "x"}', "model"),
        (b'{"model": "tiny", "stream": 1}', "stream"),
    ]:
        r = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == param
    assert httpx.get(f"{shared_platform.url}/healthz").json()["status"] == "ok"


BAD_DEPLOYS = [
    ({"model": "tiny"}, "name"),
    ({"name": "Bad Name", "model": "tiny"}, "name"),
    ({"name": "x"}, "model"),
    ({"name": "x", "model": "no-such-model"}, "model"),
    ({"name": "x", "model": "s3://bucket/m"}, "model"),
    ({"name": "x", "model": "tiny", "engine": "tpu"}, "engine"),
    ({"name": "x", "model": "tiny", "policy": "nope"}, "policy"),
    ({"name": "x", "model": "tiny", "policy": 3}, "policy"),
    ({"name": "x", "model": "tiny", "max": 0}, "max"),
    ({"name": "x", "model": "tiny", "max": 65}, "max"),
    ({"name": "x", "model": "tiny", "min_warm": 3, "max": 2}, "min_warm"),
    ({"name": "x", "model": "tiny", "min_warm": -1}, "min_warm"),
    ({"name": "x", "model": "tiny", "idle_timeout_s": 0}, "idle_timeout_s"),
    ({"name": "x", "model": "tiny", "target_concurrency": "4"}, "target_concurrency"),
    ({"name": "x", "model": "tiny", "grace_period_s": -1}, "grace_period_s"),
    ({"name": "x", "model": "tiny", "colour": "red"}, "colour"),
    ({"name": "x", "model": "tiny", "engine": "vllm"}, "engine"),  # no vllm and no GPU here
]


@pytest.mark.parametrize(("body", "param"), BAD_DEPLOYS)
def test_bad_admin_input_is_a_4xx_naming_the_field(shared_platform, body, param):
    r = httpx.post(f"{shared_platform.url}/admin/v1/deployments", json=body, timeout=deadline(30))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"]


def test_admin_not_found_and_bad_bodies(shared_platform):
    assert httpx.get(f"{shared_platform.url}/admin/v1/deployments/ghost").status_code == 404
    assert httpx.delete(f"{shared_platform.url}/admin/v1/deployments/ghost").status_code == 404
    url = f"{shared_platform.url}/admin/v1/deployments"
    assert httpx.post(url, content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(url, content=b"{").status_code == 415  # JSON only, declared as such
    # Another model under an existing name is an update, not a 409 (tests/platform/serve/test_revisions_live.py).
    cli = shared_platform.cli("rm", "ghost", check=False)
    assert cli.returncode == 1 and cli.stderr.startswith("stoker: error:") and "Traceback" not in cli.stderr
