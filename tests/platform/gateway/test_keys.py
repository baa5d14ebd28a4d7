"""API keys and tenants, end to end: a real `stoker up` on loopback, the CLI, plain HTTP.

Open mode (no STOKER_ADMIN_KEY, no keys) is what every other test in this directory runs in; here
it is checked to stay open, and everything else runs with an admin key set.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess

import httpx
import pytest

from tests.conftest import STOKER
from tests.deadlines import CLI, COLD_ANSWER, deadline
from tests.platform.engine.conftest import free_port

ADMIN = "admin-secret-for-tests"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def completion(p, key: str | None, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    return httpx.post(
        f"{p.url}/v1/completions", json=body, headers=bearer(key) if key else {}, timeout=COLD_ANSWER
    )


def test_open_mode_needs_no_key_and_says_so(platform_factory):
    p = platform_factory()
    assert httpx.get(f"{p.url}/v1/models").status_code == 200
    assert httpx.get(f"{p.url}/admin/v1/deployments").status_code == 200
    assert httpx.get(f"{p.url}/metrics").status_code == 200
    assert "OPEN MODE" in p.log.read_text()
    # Tenant keys need an admin key: one would close /v1 while the admin API stayed open.
    made = p.cli("keys", "create", "--tenant", "acme", "--deployment", "tiny", check=False)
    assert made.returncode == 1 and "STOKER_ADMIN_KEY" in made.stderr


def test_with_an_admin_key_the_admin_api_and_data_path_need_it(platform_factory):
    p = platform_factory(env={"STOKER_ADMIN_KEY": ADMIN})
    assert "OPEN MODE" not in p.log.read_text()
    for method, path in [("GET", "/admin/v1/deployments"), ("GET", "/admin/v1/keys"), ("GET", "/metrics")]:
        r = httpx.request(method, f"{p.url}{path}")
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.request(method, f"{p.url}{path}", headers=bearer("wrong")).status_code == 401
    r = httpx.get(f"{p.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert completion(p, "sk-stoker-nope", "tiny").status_code == 401
    assert httpx.get(f"{p.url}/healthz").status_code == 200
    assert httpx.get(f"{p.url}/openapi.json").status_code == 200
    assert httpx.get(f"{p.url}/v1/models", headers=bearer(ADMIN)).status_code == 200
    assert json.loads(p.cli("ls", "--json").stdout) == []  # the CLI sends $STOKER_ADMIN_KEY


def test_the_cli_without_the_admin_key_gets_one_line(platform_factory):
    p = platform_factory(env={"STOKER_ADMIN_KEY": ADMIN})
    env = {k: v for k, v in p.env.items() if k != "STOKER_ADMIN_KEY"}
    run = subprocess.run([STOKER, "ls"], env=env, capture_output=True, text=True, timeout=CLI)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "stoker: error: This route takes the admin key (STOKER_ADMIN_KEY)."
    ]


def test_a_tenant_key_calls_only_its_deployments_until_revoked(platform_factory, tiny_model_dir):
    p = platform_factory(env={"STOKER_ADMIN_KEY": ADMIN})
    p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
    p.deploy("other", tiny_model_dir, "--idle-timeout", "600")
    made = json.loads(p.cli("keys", "create", "--tenant", "acme", "--deployment", "tiny", "--json").stdout)
    assert set(made) == {"id", "key"} and made["key"].startswith("sk-stoker-")
    key = made["key"]

    listed = json.loads(p.cli("keys", "ls", "--json").stdout)
    assert [(k["id"], k["tenant"], k["deployments"]) for k in listed] == [(made["id"], "acme", ["tiny"])]
    assert key not in p.cli("keys", "ls", "--json").stdout + p.cli("keys", "ls").stdout
    stored = sqlite3.connect(p.home / "stoker.db").execute("SELECT * FROM api_keys").fetchall()
    assert len(stored) == 1 and key not in str(stored)  # stored hashed

    assert completion(p, key, "tiny").status_code == 200
    # Another tenant's deployment answers exactly as one that does not exist.
    other, missing = completion(p, key, "other"), completion(p, key, "missing")
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"
    assert other.json()["error"]["message"].replace("other", "X") == missing.json()["error"][
        "message"
    ].replace("missing", "X")
    models = httpx.get(f"{p.url}/v1/models", headers=bearer(key)).json()["data"]
    assert [m["id"] for m in models] == ["tiny"]
    admin_models = httpx.get(f"{p.url}/v1/models", headers=bearer(ADMIN)).json()["data"]
    assert sorted(m["id"] for m in admin_models) == ["other", "tiny"]
    assert completion(p, ADMIN, "other").status_code == 200
    # A tenant key is no admin key.
    assert httpx.get(f"{p.url}/admin/v1/keys", headers=bearer(key)).status_code == 401
    assert httpx.get(f"{p.url}/metrics", headers=bearer(key)).status_code == 401

    assert p.cli("keys", "revoke", made["id"]).stdout.strip() == f"revoked {made['id']}"
    assert completion(p, key, "tiny").status_code == 401
    assert json.loads(p.cli("keys", "ls", "--json").stdout) == []
    again = p.cli("keys", "revoke", made["id"], check=False)
    assert again.returncode == 1 and "No key" in again.stderr


def test_keys_survive_a_restart(platform_factory, tmp_path):
    p = platform_factory(env={"STOKER_ADMIN_KEY": ADMIN}, home=tmp_path / "home")
    made = json.loads(p.cli("keys", "create", "--tenant", "acme", "--deployment", "a", "--json").stdout)
    p.stop()
    q = platform_factory(env={"STOKER_ADMIN_KEY": ADMIN}, home=tmp_path / "home")
    assert httpx.get(f"{q.url}/v1/models", headers=bearer(made["key"])).json()["data"] == []
    assert [k["id"] for k in json.loads(q.cli("keys", "ls", "--json").stdout)] == [made["id"]]


@pytest.mark.parametrize(
    "headers, status, code",
    [
        ({"content-type": "text/plain"}, 415, "unsupported_media_type"),
        ({"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
        ({"origin": "http://127.0.0.1:{port}"}, 415, "unsupported_media_type"),  # a typeless Blob
        ({}, 415, "unsupported_media_type"),  # no type at all: JSON only means declared JSON
        ({"content-type": "application/json", "origin": "http://evil.example"}, 403, "forbidden_origin"),
        ({"content-type": "application/json", "origin": "null"}, 403, "forbidden_origin"),
    ],
)
def test_the_admin_api_refuses_what_a_foreign_page_could_send(platform_factory, headers, status, code):
    p = platform_factory(env={"STOKER_ADMIN_KEY": ADMIN})
    body = json.dumps({"tenant": "acme", "deployments": ["tiny"]})
    headers = {k: v.replace("{port}", str(p.port)) for k, v in headers.items()}
    r = httpx.post(f"{p.url}/admin/v1/keys", content=body, headers={**bearer(ADMIN), **headers})
    assert r.status_code == status and r.json()["error"]["code"] == code
    own = {"content-type": "application/json; charset=utf-8", "origin": p.url}
    assert (
        httpx.post(f"{p.url}/admin/v1/keys", content=body, headers={**bearer(ADMIN), **own}).status_code
        == 201
    )


def test_a_foreign_origin_is_refused_in_open_mode_too(platform_factory):
    p = platform_factory()
    r = httpx.get(f"{p.url}/admin/v1/deployments", headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    r = httpx.post(f"{p.url}/admin/v1/deployments", content=b"name=x", headers={"content-type": "text/plain"})
    assert r.status_code == 415


def test_a_public_bind_without_an_admin_key_is_refused_before_binding(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "STOKER_HOME": str(tmp_path / "home")}
    run = subprocess.run(
        [STOKER, "up", "--host", "0.0.0.0", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(60),
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "STOKER_ADMIN_KEY" in lines[0] and "--allow-open" in lines[0]
