"""The warm-runtime tier end to end: the real `stoker up --warm-runtimes 1`, its real `stoker runtime`
process, the tiny model. A request at zero starts the instance in the runtime (its PID becomes the
engine's, the start counts as tier runtime), a real chat request is answered, the keeper starts a
new runtime, and stopping the platform leaves no process behind."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from tests.deadlines import WAIT, deadline
from tests.platform.conftest import PlatformProcess, pid_alive
from tests.platform.engine.conftest import free_port

if sys.platform != "linux":  # pragma: no cover
    pytest.skip("runtimes need Linux's /proc", allow_module_level=True)


def runtime_pids(home: Path) -> set[int]:
    """The `stoker runtime` processes marked as this platform's (its data dir)."""
    mark = f"STOKER_ENGINE_OF={home.resolve()}".encode()
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"runtime" in argv and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return {pid for pid in found if pid_alive(pid)}


def test_a_start_takes_the_warm_runtime_which_is_then_replaced(tmp_path, tiny_model_dir):
    p = PlatformProcess(tmp_path / "home", free_port(), ("--warm-runtimes", "1", "--stable-window", "1"))
    p.start()
    seen: set[int] = set()
    try:
        p.wait_for(
            lambda: p.metric("stoker_warm_runtimes", engine="cpu") == 1, deadline(300), "a warm runtime"
        )
        [runtime] = runtime_pids(p.home)
        seen.add(runtime)
        measured = lambda: p.metric("stoker_warm_runtime_memory_bytes", engine="cpu", kind="pss") > 0  # noqa: E731
        p.wait_for(measured, WAIT, "the runtime's memory measured")
        p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
        # ignore_eos: the random tiny model may sample its end token (or tokens that decode to
        # nothing) first; the engine must generate exactly the 4 tokens asked for.
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        r = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=deadline(300))
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["finish_reason"] == "length"
        assert isinstance(answer["choices"][0]["message"]["content"], str)
        assert r.headers["x-stoker-cold-start"] == "true"
        instance = r.headers["x-stoker-instance"]
        assert p.engine_pids()[instance] == runtime  # the runtime became the engine
        assert p.metric("stoker_instance_startup_seconds_count", deployment="tiny", tier="runtime") == 1
        assert p.metric("stoker_cold_start_requests_total", deployment="tiny", tier="runtime") == 1
        log = (p.home / "logs" / f"{instance}.log").read_text()
        assert f"runtime pid {runtime}: becoming `stoker engine`" in log and "ready: serving 'tiny'" in log

        # The keeper starts another; the engine keeps serving meanwhile (perhaps asleep and woken:
        # the window is 1 s).
        p.wait_for(lambda: len(runtime_pids(p.home) - {runtime}) == 1, deadline(300), "a new runtime")
        seen |= runtime_pids(p.home)
        p.wait_for(
            lambda: p.metric("stoker_warm_runtimes", engine="cpu") == 1, deadline(300), "the new one ready"
        )
        again = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=deadline(300))
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    finally:
        code = p.stop()
    assert code == 0
    assert not any(pid_alive(pid) for pid in seen), "a runtime or an engine outlived the platform"
    assert runtime_pids(p.home) == set()


def test_a_waiting_runtime_dies_with_its_keeper_and_an_engine_it_became_does_not(tmp_path, tiny_model_dir):
    # Before: runtimes of platforms killed with SIGKILL stayed, parent 1, 355 MiB each, for hours.
    p = PlatformProcess(tmp_path / "home", free_port(), ("--warm-runtimes", "1"))
    p.start()
    engine = None
    try:
        p.wait_for(lambda: len(runtime_pids(p.home)) == 1, deadline(300), "a warm runtime")
        p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--idle-timeout", "600")
        p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, deadline(300), "READY")
        [engine] = p.engine_pids().values()
        p.wait_for(lambda: len(runtime_pids(p.home) - {engine}) == 1, deadline(300), "the next runtime")
        [waiting] = runtime_pids(p.home) - {engine}
        p.stop(signal.SIGKILL)
        p.wait_for(lambda: not pid_alive(waiting), WAIT, "the waiting runtime gone with its keeper")
        assert pid_alive(engine)  # an engine outlives a killed platform, for the next one to adopt
    finally:
        p.stop()
        if engine is not None and pid_alive(engine):
            os.kill(engine, signal.SIGKILL)
