"""`stoker up` processes for the tests: the real platform on a free loopback port, its own data dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import STOKER
from tests.deadlines import FACTOR, HOLD, HTTP_READ, PLATFORM_START, STOP, WAIT, deadline, wait_healthy
from tests.platform.engine.conftest import free_port


@dataclass
class PlatformProcess:
    home: Path
    port: int
    args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    log: Path | None = None
    env: dict = field(default_factory=dict)
    extra_env: dict = field(default_factory=dict)  # e.g. STOKER_ADMIN_KEY, for `up` and the CLI
    command: str = "up"  # or "controller", "gateway" (`stoker.serve.controller`, `stoker.serve.gateway`)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PlatformProcess:
        self.launch()
        wait_healthy(
            self.proc,
            f"{self.url}/healthz",
            PLATFORM_START,
            f"stoker {self.command}",
            self.log_tail,
            poll_s=0.05,
        )
        return self

    def launch(self) -> PlatformProcess:
        """The process started, not waited for: a standby controller answers nothing until it leads."""
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "STOKER_ADMIN_KEY"},  # open unless asked
            "STOKER_HOME": str(self.home),
            "STOKER_URL": self.url,
            "HF_HUB_OFFLINE": "1",
            **self.extra_env,
        }
        self.log = self.home / f"up-{time.monotonic_ns()}.log"
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            defaults = self._hold()
            cmd = [STOKER, self.command, "--port", str(self.port), *self.args, *defaults]
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        return self

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""

    def _hold(self) -> tuple[str, ...]:
        """A hold deadline scaled like every other bound (STOKER_TEST_TIMEOUT_FACTOR), unless the test
        chose one: held requests wait out engine starts, which a loaded machine makes longer. At a
        factor of 1 nothing is added, and the platform's default (120 s, HOLD) applies."""
        if FACTOR == 1 or self.command not in ("up", "gateway"):
            return ()
        if any(a == "--hold-deadline" or a.startswith("--hold-deadline=") for a in self.args):
            return ()
        return ("--hold-deadline", f"{HOLD:g}s")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=STOP)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [STOKER, *args], env=self.env, capture_output=True, text=True, check=check, timeout=deadline(600)
        )

    def deploy(self, name: str, model: Path | str, *flags: str) -> dict:
        return json.loads(self.cli("deploy", name, "--model", str(model), "--json", *flags).stdout)

    def admin_get(self, path: str) -> dict:
        """An admin API read over HTTP, with the admin key the CLI would send. Tests poll through
        these: a `stoker` CLI process per poll costs ~0.4 CPU-s, which on CI's 2 cores is taken from
        the engine start being waited for (the CLI's own output is tested in test_cli_*.py)."""
        admin = self.extra_env.get("STOKER_ADMIN_KEY")
        headers = {"authorization": f"Bearer {admin}"} if admin else {}
        r = httpx.get(f"{self.url}{path}", headers=headers, timeout=HTTP_READ)
        r.raise_for_status()
        return r.json()

    def deployments(self) -> dict[str, dict]:
        """`stoker ls --json`, by name."""
        return {d["name"]: d for d in self.admin_get("/admin/v1/deployments")["data"]}

    def engine_pids(self) -> dict[str, int]:
        """Instance id -> engine pid, from the records the pool keeps for crash recovery."""
        records = self.home / "instances"
        return (
            {p.stem: json.loads(p.read_text())["pid"] for p in records.glob("*.json")}
            if records.is_dir()
            else {}
        )

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        admin = self.extra_env.get("STOKER_ADMIN_KEY")
        headers = {"authorization": f"Bearer {admin}"} if admin else {}
        for line in httpx.get(f"{self.url}/metrics", headers=headers, timeout=HTTP_READ).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.split()[-1])
        return total

    def wait_for(self, condition, timeout: float = WAIT, what: str = "condition") -> None:
        """Poll `condition` until it is true, for `timeout` seconds: a bound from tests/deadlines.py
        (WAIT, ENGINE_START, `deadline(n)`), so that it scales on a loaded machine. A condition whose
        HTTP read fails (a platform too busy to answer in time) counts as not yet true."""
        end = time.monotonic() + timeout
        last = "never checked"
        while time.monotonic() < end:
            try:
                if condition():
                    return
                last = "false"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
        raise TimeoutError(
            f"{what} not reached within {timeout:g} s (last check: {last}); stoker {self.command}'s "
            f"log:\n{self.log_tail()}"
        )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone as far as serving goes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone between the open and the read: ESRCH
        return False


@pytest.fixture
def platform_factory(tmp_path: Path):
    started: list[PlatformProcess] = []

    def make(*args: str, home: Path | None = None, env: dict | None = None) -> PlatformProcess:
        home = home or tmp_path / f"home{len(started)}"
        p = PlatformProcess(home, free_port(), args, extra_env=env or {}).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture(scope="module")
def shared_platform(tmp_path_factory, tiny_model_dir):
    """One platform with the tiny model deployed at zero, for the tests that only send requests."""
    p = PlatformProcess(
        tmp_path_factory.mktemp("platform") / "home",
        free_port(),
        # A CI machine shared with a vLLM start can hold an engine's first chunk past the default 10 s
        # (then the stream is retried and, with nowhere else to go, fails): these tests are not about that.
        ("--stable-window", "2", "--stream-headers-timeout", "120s"),
    ).start()
    try:
        p.deploy("tiny", tiny_model_dir, "--max", "2", "--idle-timeout", "600")
        yield p
    finally:
        p.stop()
