"""The warm-runtime tier end to end: the real `stoker up --warm-runtimes 1`, its real `stoker runtime`
process, the tiny model. A request at zero starts the instance in the runtime (its PID becomes the
engine's, the start counts as tier runtime), a real chat request is answered, the runtime forked
its successor at the handoff (the platform's child, in a group of its own), which a second
deployment's start takes in turn, and stopping the platform leaves no process behind."""

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


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_a_start_takes_the_warm_runtime_whose_successor_takes_the_next(tmp_path, tiny_model_dir):
    p = PlatformProcess(tmp_path / "home", free_port(), ("--warm-runtimes", "1", "--stable-window", "1"))
    p.start()
    seen: set[int] = set()
    try:
        assert runtime_pids(p.home) == set()  # none before a deployment of the CPU engine exists
        p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
        p.wait_for(
            lambda: p.metric("stoker_warm_runtimes", engine="cpu") == 1, deadline(300), "a warm runtime"
        )
        [runtime] = runtime_pids(p.home)
        seen.add(runtime)
        measured = lambda: p.metric("stoker_warm_runtime_memory_bytes", engine="cpu", kind="pss") > 0  # noqa: E731
        p.wait_for(measured, WAIT, "the runtime's memory measured")
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

        # Its successor, forked at the handoff: the platform's child (it reaps it), in a process
        # group of its own; the engine keeps serving meanwhile (perhaps asleep and woken: the
        # window is 1 s).
        p.wait_for(lambda: len(runtime_pids(p.home) - {runtime}) == 1, deadline(300), "a successor")
        [successor] = runtime_pids(p.home) - {runtime}
        seen.add(successor)
        assert parent_of(successor) == p.proc.pid and os.getpgid(successor) == successor
        p.wait_for(
            lambda: p.metric("stoker_warm_runtimes", engine="cpu") == 1, deadline(300), "the successor ready"
        )
        logs = "".join(f.read_text() for f in (p.home / "logs" / "runtimes").glob("*.log"))
        assert f"runtime pid {successor}: forked at a handoff" in logs  # not a fresh process

        # A second deployment's start takes the successor, which serves it.
        p.deploy("tiny2", tiny_model_dir, "--idle-timeout", "600")
        second = httpx.post(
            f"{p.url}/v1/chat/completions", json=body | {"model": "tiny2"}, timeout=deadline(300)
        )
        assert second.status_code == 200 and second.json()["usage"]["completion_tokens"] == 4
        assert p.engine_pids()[second.headers["x-stoker-instance"]] == successor
        assert p.metric("stoker_instance_startup_seconds_count", deployment="tiny2", tier="runtime") == 1
        p.wait_for(
            lambda: len(runtime_pids(p.home) - {runtime, successor}) == 1, deadline(300), "its successor"
        )
        seen |= runtime_pids(p.home)
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
