"""Engine processes for the tests: real `stoker engine` processes on free loopback ports."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import STOKER
from tests.deadlines import ENGINE_START, STOP, deadline, wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    url: str
    log: Path

    def wait_ready(self, timeout: float = ENGINE_START) -> None:
        """Until /health is 200; `timeout` is a bound from tests/deadlines.py (it scales)."""
        wait_healthy(self.proc, f"{self.url}/health", timeout, "engine", self.log_tail)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=STOP)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class OneConnection:
    """HTTP/1.1 requests on one kept-alive socket, to show that an answer did not cost the connection:
    a server that closed it fails the next request (or makes http.client open another, caught here)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=deadline(120))
        self.sock = None

    def post(self, path: str, body: dict | bytes) -> tuple[int, dict, dict]:
        """(status, headers, JSON body) of one POST."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.conn.request("POST", path, body=content, headers={"content-type": "application/json"})
        response = self.conn.getresponse()
        answer = json.loads(response.read())
        self.sock = self.sock or self.conn.sock
        assert self.conn.sock is self.sock, "the server closed the connection"
        return response.status, dict(response.getheaders()), answer

    def close(self) -> None:
        self.conn.close()


def launch_engine(snapshot: Path, log_dir: Path, *extra: str, env: dict | None = None) -> EngineProcess:
    port = free_port()
    log = log_dir / f"engine-{port}.log"
    cmd = [STOKER, "engine", "--snapshot", str(snapshot), "--port", str(port), "--served-model-name", "tiny"]
    cmd += ["--threads", "1", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ.copy())
    return EngineProcess(proc, f"http://127.0.0.1:{port}", log)


@pytest.fixture(scope="session")
def tiny_snapshot(tiny_model_dir: Path, stoker_env: dict) -> Path:
    """The tiny model imported into the session's snapshot store, as the platform would."""
    out = subprocess.run(
        [STOKER, "snapshot", "import", str(tiny_model_dir), "--name", "tiny", "--json"],
        env=stoker_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=deadline(300),
    )
    return Path(json.loads(out.stdout)["path"])


@pytest.fixture(scope="session")
def engine(tiny_snapshot: Path, tmp_path_factory, stoker_env) -> Iterator[EngineProcess]:
    """One engine shared by the tests that only send requests."""
    e = launch_engine(tiny_snapshot, tmp_path_factory.mktemp("engine-logs"), env=stoker_env)
    try:
        e.wait_ready()
        yield e
    finally:
        e.stop()


@pytest.fixture
def fresh_engine(tiny_snapshot: Path, tmp_path: Path, stoker_env):
    """A factory of engines with their own flags, stopped after the test."""
    started: list[EngineProcess] = []

    def start(*extra: str) -> EngineProcess:
        e = launch_engine(tiny_snapshot, tmp_path, *extra, env=stoker_env)
        started.append(e)
        e.wait_ready()
        return e

    yield start
    for e in started:
        e.stop()


if sys.platform != "linux":  # pragma: no cover
    pytest.skip("the engine tests need Linux process semantics", allow_module_level=True)
