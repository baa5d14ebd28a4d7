"""The API as its OpenAPI schema describes it, fuzzed by schemathesis against a running platform.

Bounded: a fixed seed, a few examples per operation, a timeout per request and for the whole run.
What must hold: no 5xx, no hang, and the instance behind the deployment still serves afterwards.
The schema is the one the platform serves at /openapi.json, with `model` pinned to the deployed
model so that generation requests reach the engine instead of stopping at a 404; removing a
deployment is left out (it would only take the fuzzed deployment away). A fuzzed deploy names paths
like `/` or `.`: the importer refuses them before walking anything.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
from prometheus_client import CollectorRegistry

from stoker.gateway.drift import Drift
from stoker.gateway.request_log import Observer
from stoker.serve.up import build_gateway
from tests.deadlines import COLD_ANSWER, deadline

ST = Path(sys.executable).with_name("st")


def test_the_served_schema_is_openapi_and_names_every_route(shared_platform):
    schema = httpx.get(f"{shared_platform.url}/openapi.json").json()
    assert schema["openapi"].startswith("3.1")
    # Every route the gateway serves is described, and nothing else (`{model:path}` is `{model}`).
    # With the request observer `stoker up` always builds (its drift routes).
    observer = Observer(None, Drift(300, 20))
    app = build_gateway(SimpleNamespace(metrics_registry=CollectorRegistry()), observer=observer)
    served = {re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path) for route in app.routes}
    assert set(schema["paths"]) == served - {"/openapi.json"}
    assert "/v1/models/{model}" in served and "/admin/v1/deployments/{name}/logs" in served


def test_fuzzing_the_api_finds_no_server_error_and_breaks_nothing(platform_factory, tiny_model_dir, tmp_path):
    p = platform_factory("--stable-window", "600")
    p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    before = httpx.post(f"{p.url}/v1/completions", json=body, timeout=COLD_ANSWER)
    assert before.status_code == 200
    instance = before.headers["x-stoker-instance"]

    schema = httpx.get(f"{p.url}/openapi.json").json()
    budgets = {
        "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
        "/v1/completions": ("max_tokens", "max_completion_tokens"),
        "/v1/responses": ("max_output_tokens",),
    }
    for path, names in budgets.items():
        request = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        request["properties"]["model"] = {"const": "tiny"}
        # Long generations only cost time here: what is fuzzed is the input, not the output length.
        for name in names:
            request["properties"][name] = {"type": "integer", "minimum": 1, "maximum": 8}
        request["required"] = [*request["required"], names[0]]
    del schema["paths"]["/admin/v1/deployments/{name}"]["delete"]
    # A follow streams until the client leaves, which a fuzzer's request timeout would call a hang.
    logs = schema["paths"]["/admin/v1/deployments/{name}/logs"]["get"]
    logs["parameters"] = [q for q in logs["parameters"] if q["name"] != "follow"]
    spec = tmp_path / "openapi.json"
    spec.write_text(json.dumps(schema))

    run = subprocess.run(
        [
            str(ST), "run", str(spec), "--url", p.url,
            "--checks", "not_a_server_error",
            "--max-examples", "40",
            "--seed", "20261130",
            "--request-timeout", "60",
            "--max-response-time", "60",
            "--phases", "examples,coverage,fuzzing",
            "--workers", "1",
        ],
        capture_output=True, text=True, timeout=deadline(420),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]

    after = httpx.post(f"{p.url}/v1/completions", json=body, timeout=COLD_ANSWER)
    assert after.status_code == 200 and after.headers["x-stoker-instance"] == instance
    assert httpx.get(f"{p.url}/healthz").status_code == 200
