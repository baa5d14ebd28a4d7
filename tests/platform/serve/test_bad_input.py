"""Bad input through `stoker up`: refused by the gateway or by the engine behind it, and neither the
instance nor the client's connection is the worse for it."""

from __future__ import annotations

import httpx

from tests.platform.engine.conftest import OneConnection
from tests.platform.engine.test_bad_input import nested


def test_hostile_bodies_leave_the_instance_and_the_connection_serving(shared_platform):
    conn = OneConnection(shared_platform.url)
    try:
        # The engine's refusal (the gateway only reads `model` and `stream`), relayed as it is.
        status, headers, answer = conn.post("/v1/completions", {"model": "tiny", "prompt": ""})
        assert (status, answer["error"]["param"]) == (400, "prompt"), answer
        instance = headers["x-stoker-instance"]
        # The gateway's own, from its parser, before any instance is picked.
        status, _, answer = conn.post("/v1/completions", {"model": "tiny", "prompt": "\ud800"})
        assert (status, answer["error"]["param"]) == (400, "prompt"), answer
        status, _, answer = conn.post("/v1/chat/completions", nested(100_000))
        assert (status, answer["error"]["code"]) == (400, "invalid_json"), answer
        # The same instance still generates: its loop never saw the empty prompt.
        status, headers, answer = conn.post(
            "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}
        )
        assert status == 200, answer
        assert headers["x-stoker-instance"] == instance
    finally:
        conn.close()
    assert httpx.get(f"{shared_platform.url}/healthz").status_code == 200


def test_one_body_limit_the_gateways(shared_platform):
    # 3.5 MB: under the gateway's 4 MiB, so the engine takes it too (it answered 413 at its own
    # 1 MiB) and says what is wrong with it: a prompt longer than the model's context.
    words = "hello " * (3_500_000 // 6)
    body = {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": 2}
    r = httpx.post(f"{shared_platform.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] != "request_too_large" and "x-stoker-instance" in r.headers
    # Over 4 MiB: the gateway's 413, before any instance is picked.
    body["messages"][0]["content"] = "hello " * (4_500_000 // 6)
    r = httpx.post(f"{shared_platform.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    assert "x-stoker-instance" not in r.headers


def test_engine_settings_are_refused_in_one_line_or_carried_by_a_new_revision(
    shared_platform, tiny_model_dir
):
    p = shared_platform
    # More GPUs than this machine has (none): refused at deploy, naming what was asked and what there is.
    out = p.cli("deploy", "big", "--model", str(tiny_model_dir), "--gpus", "1", check=False)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "asks for 1 GPU(s), and at most 0 can be given to one instance here" in out.stderr
    # A passthrough argument that collides with what Stoker manages, named.
    out = p.cli(
        "deploy",
        "big",
        "--model",
        str(tiny_model_dir),
        "--engine",
        "vllm",
        "--engine-arg=--port=9",
        check=False,
    )
    assert out.returncode == 1 and "'engine_args' may not pass --port: Stoker sets it" in out.stderr
    assert "big" not in p.deployments()  # nothing half-made
    # Accepted: shown by describe, in the admin API, and a change is a new revision that warms first.
    first = p.deploy(
        "sized", tiny_model_dir, "--max-model-len", "256", "--cpu", "2", "--toleration", "gpu:NoSchedule"
    )
    assert first["deployed"]["revision"] == 1
    described = p.cli("describe", "sized").stdout
    assert "Engine settings: max_model_len 256; cpu 2; tolerations gpu:NoSchedule" in described, described
    api = p.admin_get("/admin/v1/deployments/sized")
    assert (api["max_model_len"], api["cpu"], api["tolerations"]) == (
        256,
        "2",
        [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    second = p.deploy("sized", tiny_model_dir, "--max-model-len", "512")
    assert (second["deployed"]["revision"], second["deployed"]["state"]) == (2, "warming")
    p.cli("rm", "sized")
