"""The two planes on TLS (`stoker.tls`): a `stoker controller` serving HTTPS with a self-signed set
(`stoker tls init`), a gateway that verifies it against the CA and serves HTTPS itself, and a
gateway given another CA. One set of processes for the module: a request goes end to end over TLS
(client → gateway → engine, the engine started by the controller on HTTPS and verified by the
gateway); the gateway with the wrong CA refuses the controller and says why; plain HTTP to the
controller's port, or to the engine's, gets nothing (the routing table with the engines' keys
never crosses in clear)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stoker.tls.certs import init
from tests.deadlines import COLD_ANSWER, HTTP_READ, PLATFORM_START, WAIT, deadline, flag
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

ADMIN = "admin-key-for-planes-tls"
H = {"authorization": f"Bearer {ADMIN}"}


@dataclass
class TlsProcess(PlatformProcess):
    """A platform process whose port serves HTTPS, verified against `ca` (`PlatformProcess` knows
    only plain HTTP: its URL and its health wait are overridden here)."""

    ca: Path | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.port}"

    def verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else True

    def start(self) -> TlsProcess:
        self.launch()
        self.wait_for(
            lambda: self.proc.poll() is None and self.get("/healthz").status_code == 200,
            PLATFORM_START,
            f"stoker {self.command} healthy",
        )
        return self

    def get(self, path: str, **params: str) -> httpx.Response:
        return httpx.get(
            f"{self.url}{path}", params=params, headers=H, verify=self.verify(), timeout=HTTP_READ
        )


def tls_args(d: Path, *, serve: bool = True) -> tuple[str, ...]:
    own = ("--tls-cert", str(d / "tls.crt"), "--tls-key", str(d / "tls.key")) if serve else ()
    return (*own, "--tls-ca", str(d / "ca.crt"))


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("planes-tls")
    ours, theirs = root / "tls", root / "other-ca"
    init(ours)
    init(theirs)
    ca = ours / "ca.crt"
    env = {"STOKER_ADMIN_KEY": ADMIN, "STOKER_CA": str(ca)}  # the CLI verifies the gateway with it
    controller = TlsProcess(
        root / "controller",
        free_port(),
        ("--stable-window", "1", "--stop-instances-on-exit", *tls_args(ours)),
        extra_env=env,
        command="controller",
        ca=ca,
    ).start()
    common = ("--controller", controller.url, "--report-interval", "0.2s", "--hold-deadline", flag(120))
    gateway = TlsProcess(
        root / "gw",
        free_port(),
        (*common, "--gateway-id", "gw-ok", *tls_args(ours)),
        extra_env=env,
        command="gateway",
        ca=ca,
    ).start()
    stranger = TlsProcess(  # trusts another CA; serves plain HTTP itself
        root / "gw-other",
        free_port(),
        (*common, "--gateway-id", "gw-other", *tls_args(theirs, serve=False)),
        extra_env=env,
        command="gateway",
    ).start()
    yield controller, gateway, stranger
    for p in (stranger, gateway, controller):
        p.stop()


def test_a_request_goes_end_to_end_over_tls(planes, tiny_model_dir: Path) -> None:
    controller, gateway, _ = planes
    # The admin API through the gateway (the CLI verifies it with $STOKER_CA; it, the controller).
    deployed = gateway.deploy("m", tiny_model_dir, "--min-warm", "0", "--max", "1", "--idle-timeout", "600")
    assert deployed["name"] == "m"
    gateway.wait_for(lambda: "m" in [m["id"] for m in gateway.get("/v1/models").json()["data"]])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers=H,
        verify=gateway.verify(),
        timeout=COLD_ANSWER,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None

    # The engine the controller started serves HTTPS: its address in the table says so, the CA
    # vouches for it, and plain HTTP to its port gets no answer.
    table = controller.get("/cluster/v1/routes", gateway="probe").json()
    [endpoint] = table["deployments"]["m"]["units"]["1"]["endpoints"]
    assert endpoint["url"].startswith("https://127.0.0.1:")
    health = httpx.get(f"{endpoint['url']}/health", verify=controller.verify(), timeout=HTTP_READ)
    assert health.status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(endpoint["url"].replace("https://", "http://") + "/health", timeout=HTTP_READ)
    # The gateway's own view: it reached the controller and holds its table.
    assert gateway.get("/healthz").json()["controller"] == "reachable"


def test_a_gateway_given_another_ca_refuses_the_controller(planes) -> None:
    _, _, stranger = planes

    def refused() -> bool:
        health = stranger.get("/healthz").json()
        return health["controller"] == "unreachable" and "certificate" in (
            health.get("controller_error") or ""
        )

    stranger.wait_for(refused, WAIT, "the gateway to refuse the controller's certificate")
    assert "certificate verify failed" in stranger.log_tail(20_000)
    # It learned nothing: no table, no deployment, no engine key.
    assert stranger.get("/v1/models").json()["data"] == []


def test_plain_http_to_the_controller_gets_no_routing_table(planes) -> None:
    controller, _, _ = planes
    plain = f"http://127.0.0.1:{controller.port}/cluster/v1/routes"
    with pytest.raises(httpx.TransportError):
        httpx.get(plain, params={"gateway": "plain"}, headers=H, timeout=deadline(10))
    # The same port over TLS, verified, answers it.
    assert controller.get("/cluster/v1/routes", gateway="tls").status_code == 200


def test_one_process_serves_https_and_reaches_its_engines_over_tls(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`stoker up` with the same three files: its port on HTTPS, its activator's proxy, health
    probes and the engines' metrics (`/metrics/engines`) over TLS to an engine it started so."""
    init(tmp_path / "tls")
    ca = tmp_path / "tls" / "ca.crt"
    up = TlsProcess(
        tmp_path / "up",
        free_port(),
        tls_args(tmp_path / "tls"),
        extra_env={"STOKER_ADMIN_KEY": ADMIN, "STOKER_CA": str(ca)},
        ca=ca,
    ).start()
    try:
        up.deploy("m", tiny_model_dir, "--min-warm", "0", "--max", "1")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(
            f"{up.url}/v1/chat/completions", json=body, headers=H, verify=up.verify(), timeout=COLD_ANSWER
        )
        assert r.status_code == 200, r.text
        engines = up.get("/metrics/engines")
        assert engines.status_code == 200 and 'deployment="m"' in engines.text
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{up.port}/healthz", timeout=deadline(10))
    finally:
        up.stop()
