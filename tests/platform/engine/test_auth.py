"""An engine started with a key (as the platform starts every instance) serves only who has it."""

from __future__ import annotations

import httpx
import pytest

from stoker.engine.app import API_KEY_ENV
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


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/sleep"), ("POST", "/wake_up"),
     ("GET", "/metrics"), ("GET", "/server_info"), ("GET", "/is_sleeping")],
)  # fmt: skip
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
