"""A `stoker up` in open mode (no STOKER_ADMIN_KEY: `make run`'s default) against the pages of
other sites, from outside, with raw HTTP as a browser would send it:

- a DNS-rebinding page (its own name, pointed at 127.0.0.1) sends its name as `Host`: the admin
  reads, `/metrics` and the inference routes refuse it (400 `invalid_host`, OpenAI's shape), where
  they used to answer 200 with data;
- a cross-site `text/plain` POST (a "simple" request: no CORS preflight) to `/v1/chat/completions`
  is a 415, and a request with another site's `Origin` a 403, before any model is touched;
- the platform's own names, and clients that send JSON (the openai client, curl with its header),
  are served as before.
"""

from __future__ import annotations

import httpx
import pytest

from tests.deadlines import HTTP_READ
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

READS = (
    "/admin/v1/deployments",
    "/admin/v1/history",
    "/admin/v1/keys",
    "/admin/v1/cost",
    "/metrics",
    "/v1/models",
)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def open_platform(tmp_path_factory):
    p = PlatformProcess(tmp_path_factory.mktemp("open") / "home", free_port()).start()
    yield p
    p.stop()


def refusal(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["code"] == code and error["message"], error


@pytest.mark.parametrize("path", READS)
def test_a_foreign_host_reads_nothing(open_platform, path):
    url = open_platform.url
    refusal(httpx.get(url + path, headers={"host": "evil.example"}, timeout=HTTP_READ), 400, "invalid_host")
    for name in ("127.0.0.1", "localhost"):
        host = f"{name}:{open_platform.port}"
        assert httpx.get(url + path, headers={"host": host}, timeout=HTTP_READ).status_code == 200, path


def test_a_rebound_or_cross_site_page_cannot_spend_compute(open_platform):
    url = f"{open_platform.url}/v1/chat/completions"
    rebound = httpx.post(url, json=CHAT, headers={"host": "evil.example:8080"}, timeout=HTTP_READ)
    refusal(rebound, 400, "invalid_host")
    plain = httpx.post(
        url, content=b'{"model": "tiny"}', headers={"content-type": "text/plain"}, timeout=HTTP_READ
    )
    refusal(plain, 415, "unsupported_media_type")
    foreign = httpx.post(url, json=CHAT, headers={"origin": "http://evil.example"}, timeout=HTTP_READ)
    refusal(foreign, 403, "forbidden_origin")
    # JSON from a client (no Origin, its own Host) reaches the gateway: no such model here.
    refusal(httpx.post(url, json=CHAT, timeout=HTTP_READ), 404, "model_not_found")
    # The upload route takes multipart, and keeps the Origin check.
    files = {"file": ("in.jsonl", b"{}\n")}
    upload = httpx.post(
        f"{open_platform.url}/v1/files",
        files=files,
        data={"purpose": "batch"},
        headers={"origin": "http://evil.example"},
        timeout=HTTP_READ,
    )
    refusal(upload, 403, "forbidden_origin")
    ok = httpx.post(
        f"{open_platform.url}/v1/files", files=files, data={"purpose": "batch"}, timeout=HTTP_READ
    )
    assert ok.status_code == 200, ok.text
