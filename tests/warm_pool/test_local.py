"""The local backend on real processes: a real `stoker engine`, stubborn ones, ones that die early."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from tests.deadlines import ENGINE_START, deadline
from tests.warm_pool.rig import at
from warm_pool.backends.local import LocalBackend, free_port, log_tail
from warm_pool.backends.procs import read_start_ticks
from warm_pool.engine_calls import EngineCapabilities, HttpEngines
from warm_pool.errors import StartFailed
from warm_pool.launch import LaunchSpec, cpu_engine_spec

from .support import SLEEPER, STUBBORN_WITH_CHILD, pid_gone, python, read_pid_line, wait_gone

if sys.platform != "linux":  # pragma: no cover
    pytest.skip("the local backend needs Linux's /proc", allow_module_level=True)


async def test_a_real_engine_starts_reports_its_phases_and_drains_to_exit_0(
    tmp_path, tiny_model_dir, stoker_env
):
    backend = LocalBackend(tmp_path / "logs")
    port = free_port()
    spec = cpu_engine_spec(tiny_model_dir, port, "tiny", threads=1)
    offline = {k: stoker_env[k] for k in ("STOKER_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    spec = replace(spec, env={**spec.env, **offline})
    handle = await backend.start(at("tiny-0a1b2c3d", port), spec)
    try:
        assert handle.pgid == handle.pid == os.getpgid(handle.pid) != os.getpgid(0)
        assert handle.start_ticks == read_start_ticks(handle.pid)
        await backend.wait_ready(handle, timeout_s=ENGINE_START)
        assert backend.is_alive(handle)
        phases = await HttpEngines(LocalBackend(tmp_path)).read_startup_phases(f"http://127.0.0.1:{port}")
        assert {"imports", "weight_load", "warm_up"} <= phases.keys()
        assert all(v > 0 for v in phases.values())
        caps = await HttpEngines(LocalBackend(tmp_path)).read_capabilities(f"http://127.0.0.1:{port}")
        assert caps == EngineCapabilities((1, 2)) and caps.can_sleep
    finally:
        code = await backend.stop(handle, term_timeout_s=deadline(30))
    assert code == 0
    assert pid_gone(handle.pid)
    with pytest.raises(ProcessLookupError):
        os.kill(handle.pid, 0)  # reaped, not a zombie
    with pytest.raises(ProcessLookupError):
        os.killpg(handle.pgid, 0)  # and nothing is left in its group
    assert not backend.is_alive(handle)
    assert await backend.stop(handle, term_timeout_s=1) is None  # again: nothing to do
    assert "ready: serving 'tiny'" in (tmp_path / "logs" / "tiny-0a1b2c3d.log").read_text()


async def test_a_process_ignoring_sigterm_is_killed_with_its_whole_group(tmp_path):
    backend = LocalBackend(tmp_path)
    handle = await backend.start(at("stubborn-1"), LaunchSpec(python(STUBBORN_WITH_CHILD)))
    child = await read_pid_line(tmp_path / "stubborn-1.log")
    assert os.getpgid(child) == handle.pgid
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    code = await backend.stop(handle, term_timeout_s=0.5)
    assert loop.time() - t0 >= 0.5  # SIGTERM was given its time, and ignored
    assert code == -signal.SIGKILL
    assert pid_gone(handle.pid)
    assert await wait_gone(child), f"child {child} of the killed group still runs"


async def test_a_process_that_exits_while_starting_fails_with_its_log_tail(tmp_path):
    backend = LocalBackend(tmp_path)
    code = "import sys; print('loading weights'); print('boom: no config.json', file=sys.stderr); sys.exit(3)"
    spec = LaunchSpec(python(code))
    for _ in range(2):  # the log is appended to, not replaced
        handle = await backend.start(at("dies-1"), spec)
        with pytest.raises(StartFailed) as err:
            await backend.wait_ready(handle, timeout_s=deadline(30))
        assert await backend.stop(handle, term_timeout_s=1) == 3
    message = str(err.value)
    assert "exited with status 3 before it was ready" in message
    assert message.endswith(
        "log: loading weights | boom: no config.json | loading weights | boom: no config.json"
    )
    assert "\n" not in message
    assert err.value.exit_code == 3


async def test_a_process_that_never_answers_times_out(tmp_path):
    backend = LocalBackend(tmp_path)
    handle = await backend.start(at("mute-1"), LaunchSpec(python(SLEEPER)))
    with pytest.raises(StartFailed, match=r"not ready after 0.3s \(last: ClientConnectorError\)"):
        await backend.wait_ready(handle, timeout_s=0.3, interval_s=0.05)
    assert backend.is_alive(handle)  # the caller decides what to do with it
    assert await backend.stop(handle, term_timeout_s=5) == -signal.SIGTERM


async def test_is_alive_wants_the_same_pid_and_start_time(tmp_path):
    backend = LocalBackend(tmp_path)
    handle = await backend.start(at("s-1"), LaunchSpec(python(SLEEPER)))
    try:
        assert backend.is_alive(handle)
        assert not backend.is_alive(replace(handle, start_ticks=handle.start_ticks + 1))  # a recycled PID
        assert LocalBackend(tmp_path).is_alive(handle)  # another backend (a restarted run) agrees
    finally:
        await backend.stop(handle, term_timeout_s=5)
    assert not backend.is_alive(handle)
    assert not LocalBackend(tmp_path).is_alive(handle)


async def test_stop_of_a_process_that_already_exited_returns_its_status(tmp_path):
    backend = LocalBackend(tmp_path)
    handle = await backend.start(at("quick-1"), LaunchSpec(python("raise SystemExit(7)")))
    assert await wait_gone(handle.pid)
    assert await backend.stop(handle, term_timeout_s=1) == 7


async def test_a_specs_python_path_goes_ahead_on_the_processs_pythonpath(tmp_path):
    backend = LocalBackend(tmp_path)
    printing = python("import os; print(os.environ['PYTHONPATH'].split(os.pathsep)[0])")
    handle = await backend.start(at("path-1"), LaunchSpec(printing, python_path=(str(tmp_path / "guard"),)))
    assert await wait_gone(handle.pid)
    assert await backend.stop(handle, term_timeout_s=1) == 0
    assert backend.log_path("path-1").read_text() == f"{tmp_path / 'guard'}\n"


async def test_startup_phases_are_empty_when_the_engine_has_none(tmp_path):
    async def metrics(_):
        return web.Response(
            text='# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="x"} 0.0\n'
        )

    runner = web.AppRunner(web.Application())
    runner.app.router.add_get("/metrics", metrics)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        assert await HttpEngines(LocalBackend(tmp_path)).read_startup_phases(f"http://127.0.0.1:{port}") == {}
    finally:
        await runner.cleanup()
    assert (
        await HttpEngines(LocalBackend(tmp_path)).read_startup_phases(f"http://127.0.0.1:{port}") == {}
    )  # nobody there


async def test_vllms_phases_come_from_its_log_when_its_metrics_have_none(tmp_path):
    backend = LocalBackend(tmp_path)
    backend.log_path("v-1").write_text(
        "(Worker pid=1) INFO 11-30 19:55:58 [default_loader.py:501] Loading weights took 1.65 seconds\n"
        "(EngineCore pid=2) INFO 11-30 19:57:01 [core.py:402] init engine (profile, create kv cache, "
        "warmup model) took 60.83 s\n"
    )
    phases = await HttpEngines(LocalBackend(tmp_path)).read_startup_phases(
        "http://127.0.0.1:9", "v-1"
    )  # nobody there
    assert phases == {"weights": 1.65, "engine_init": 60.83}


# vLLM 0.32's real answer (its CPU build in dev mode, trimmed: tests/data/README.md), and the same
# answer from a launch with `--enable-sleep-mode`, which sets the one field the pool reads.
VLLM_INFO = json.loads((Path(__file__).parents[1] / "data" / "vllm-0.32.0-cpu-server-info.json").read_text())
VLLM_INFO_SLEEP = {
    **VLLM_INFO,
    "vllm_config": {
        **VLLM_INFO["vllm_config"],
        "model_config": {**VLLM_INFO["vllm_config"]["model_config"], "enable_sleep_mode": True},
    },
}
VLLM_INFO_TEXT = {**VLLM_INFO_SLEEP, "vllm_config": "model='tiny-llama', enable_sleep_mode=True"}


@pytest.mark.parametrize(
    ("status", "body", "levels"),
    [
        (200, {"sleep_levels": [2, 1]}, (1, 2)),  # the CPU engine
        (200, VLLM_INFO_SLEEP, (1, 2)),  # vLLM with sleep mode (dev mode serves the route)
        (200, VLLM_INFO, ()),  # vLLM's CPU build: no sleep mode
        (200, VLLM_INFO_TEXT, ()),  # the config as text (no config_format=json): says nothing
        (200, {"vllm_config": {"model_config": {"enable_sleep_mode": "true"}}}, ()),
        (200, {"sleep_levels": ["1"]}, ()),
        (200, [1, 2], ()),
        (200, "not json", ()),
        (404, {"detail": "Not Found"}, ()),  # vLLM outside dev mode: no /sleep either
        (200, {"sleep_levels": [1], "pad": "x" * (2 << 20)}, ()),  # over the size bound: ignored
    ],
)
async def test_an_engine_says_which_sleep_levels_it_has(tmp_path, status, body, levels):
    async def info(request):
        assert request.query["config_format"] == "json"
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, content_type="application/json")

    runner = web.AppRunner(web.Application())
    runner.app.router.add_get("/server_info", info)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        caps = await HttpEngines(LocalBackend(tmp_path)).read_capabilities(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    assert caps.sleep_levels == levels and caps.can_sleep is bool(levels)


def test_a_vllm_that_died_shows_its_error_not_the_leak_report_after_it(tmp_path):
    log = tmp_path / "v.log"
    log.write_text(
        "(APIServer pid=1) WARNING 11-30 19:54:28 [system_utils.py:255] failed to raise ulimit: OSError\n"
        "(EngineCore pid=2) ERROR 11-30 19:54:02 [core.py:1512] RuntimeError: Worker failed with error "
        "'Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0'\n"
        "(APIServer pid=1) INFO 11-30 19:54:02 [core_client.py:770] [shutdown] MPClient: start timeout=0s\n"
        "nanobind: leaked 4 instances!\n"
        + "".join(f' - leaked type "triton._C.t{i}"\n' for i in range(60))
        + " - ... skipped remainder\n"
        "nanobind: this is likely caused by a reference counting issue in the binding code.\n"
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html\n"
    )
    error = (
        "(EngineCore pid=2) ERROR 11-30 19:54:02 [core.py:1512] RuntimeError: Worker failed with error "
        "'Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0'"
    )
    ulimit = "(APIServer pid=1) WARNING 11-30 19:54:28 [system_utils.py:255] failed to raise ulimit: OSError"
    assert log_tail(log) == f"{ulimit} | {error}"
    # Further back than the last lines, the error still leads (a warning is not an error).
    log.write_text(log.read_text() + "".join(f"(APIServer pid=1) INFO line {i}\n" for i in range(6)))
    assert (
        log_tail(log, lines=3) == f"{error} | (APIServer pid=1) INFO line 4 | (APIServer pid=1) INFO line 5"
    )


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


async def test_an_engine_recorded_with_the_other_scheme_is_replaced_not_adopted(tmp_path):
    """TLS turned on between two runs: the plain-HTTP engine the first left is stopped, not adopted
    (and the other way round), so no engine goes on serving in clear."""
    import ssl

    from warm_pool.backends.records import InstanceRecords
    from warm_pool.engine_tls import EngineTls

    records = InstanceRecords(tmp_path / "instances")
    plain = LocalBackend(tmp_path, records=records)
    handle = await plain.start(at("e-1", 8123, secret="k"), LaunchSpec(python(SLEEPER)))
    assert [r.url for r in records.all()] == ["http://127.0.0.1:8123"]
    tls = EngineTls("/t/tls.crt", "/t/tls.key", ssl.create_default_context())
    assert await LocalBackend(tmp_path, records=records, engine_tls=tls).running() == []
    assert await wait_gone(handle.pid) and records.all() == []
    # The same run's scheme is adopted as before.
    again = await plain.start(at("e-2", 8124, secret="k"), LaunchSpec(python(SLEEPER)))
    try:
        assert [r.instance_id for r in await LocalBackend(tmp_path, records=records).running()] == ["e-2"]
    finally:
        await plain.stop(again, 5.0)
