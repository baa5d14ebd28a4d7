"""An engine started with a key (as the platform starts every instance) serves only who has it:
every route it serves but `/health` (the list below is checked against the app's own routes, so a
route added later is covered or this fails), and any path it does not serve."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from stoker.engine.app import API_KEY_ENV, OPEN_PATHS, build_app
from tests.platform.engine.conftest import launch_engine
from warm_pool.launch import ENGINE_KEY_ENV

KEY = "s3cret-instance-key"


@pytest.fixture(scope="module")
def keyed_engine(tiny_snapshot, tmp_path_factory, stoker_env):
    e = launch_engine(tiny_snapshot, tmp_path_factory.mktemp("keyed"), env={**stoker_env, API_KEY_ENV: KEY})
    try:
        e.wait_ready()  # /health needs no key: readiness says nothing and changes nothing
        yield e
    finally:
        e.stop()


# Every route of stoker.engine.app.build_app but /health, path parameters filled in.
ROUTES = [
    ("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/metrics"),
    ("GET", "/server_info"), ("GET", "/is_sleeping"), ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/embeddings"), ("POST", "/v1/responses"),
]  # fmt: skip


def test_the_list_is_every_route_the_engine_serves_but_health():
    engine = SimpleNamespace(config=SimpleNamespace(served_model_name="tiny"))  # read at build only
    app = build_app(engine, max_body_bytes=1, on_startup=lambda: None, on_shutdown=lambda: None, api_key=KEY)
    served = {
        (method, route.path.replace("{model:path}", "tiny"))
        for route in app.routes
        for method in route.methods - {"HEAD"}
    }
    assert OPEN_PATHS == {"/health"}
    assert served - {("GET", "/health")} == set(ROUTES)


@pytest.mark.parametrize(("method", "path"), [*ROUTES, ("POST", "/collective_rpc"), ("GET", "/docs")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY])
def test_without_the_key_every_route_but_health_is_a_401(keyed_engine, method, path, auth):
    headers = {"authorization": auth} if auth else {}
    r = httpx.request(method, keyed_engine.url + path, headers=headers, json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"


def test_with_the_key_it_serves(keyed_engine):
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{keyed_engine.url}/v1/completions", json=body, headers=headers).status_code == 200
    assert httpx.get(f"{keyed_engine.url}/server_info", headers=headers).json()["sleep_levels"] == [1, 2]
    assert httpx.get(f"{keyed_engine.url}/health").status_code == 200


def test_the_launch_and_the_engine_name_the_same_variable():
    assert ENGINE_KEY_ENV == API_KEY_ENV
