"""The reliability suite: faults under sustained load, with every request's outcome counted.

The real `stoker up` on loopback, real CPU engine processes with the tiny model, concurrent plain
and streaming requests (completions and chat) while the fault happens. Each request is complete,
cleanly refused (503 + Retry-After, or an SSE error event in OpenAI's shape) or lost (reset, cut
stream, another 5xx, a hang): `reliability_support.py` says exactly how. The promise in every
scenario is zero lost, and the number complete where the scenario can promise one.

| scenario | fault | promise |
|---|---|---|
| churn | repeated scale to zero, requests at zero and while the last instance drains | every request complete |
| instance SIGKILL | one of two instances killed under load | none lost; every request sent after the kill complete; the instance replaced |
| instance SIGSTOP | one of two instances stopped under load | none lost or hung past the bound; after the ejection every request goes to the other |
| (its minimal case) | a stream's instance stopped after its first token | the stream ends with an error event seconds after the ejection |
| control plane SIGKILL | `stoker up` killed under load, restarted on its data dir | requests in flight at the kill fail on the client (counted apart); no engine of the first run left; after restart all complete |
| (a case it found) | `stoker up` killed between spawning an engine and recording it | no engine of the first run left: the restart stops it by the owner mark in its environment |
| full hold queue | more requests at zero than `--max-queued` | exactly the excess refused at once (503, Retry-After), every held one complete |

Every interval comes from a flag (idle timeout, stable window, health interval, eject after,
stream-headers timeout, hold deadline, keep-alive interval); every wait polls the admin API or the
metrics with a generous deadline, so nothing depends on how fast an engine starts. Each scenario has a
hard bound (`SCENARIO_S`) over all of it. The counts are printed, and written as JSON to
$STOKER_RELIABILITY_OUT when set (the README's table is made from them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.deadlines import deadline, flag
from tests.platform.conftest import PlatformProcess, pid_alive
from tests.platform.reliability_support import (
    COMPLETE,
    REFUSED,
    SICK_FLAGS,
    Load,
    Outcome,
    ScenarioResult,
    burst,
    describe,
    lost,
    tally,
    write_results,
)

# A hard bound on a whole scenario, start-ups included (a busy 2-core machine: ~15-25 s).
SCENARIO_S = deadline(150)
REQUEST_S = deadline(60)  # one request's bound: past it, it is a hang (counted lost)
RESULTS: list[ScenarioResult] = []


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    write_results("reliability", RESULTS, "STOKER_RELIABILITY_OUT")


def record(result: ScenarioResult) -> None:
    RESULTS.append(result)
    print(f"\n{result.as_dict()}")


def result(
    scenario: str,
    fault: str,
    outcomes: list[Outcome],
    began: float,
    *,
    failed_at_fault: int = 0,
    notes: str = "",
) -> ScenarioResult:
    counts = tally(outcomes)
    return ScenarioResult(
        scenario,
        fault,
        requests=len(outcomes) + failed_at_fault,
        complete=counts[COMPLETE],
        refused=counts[REFUSED],
        lost=len(lost(outcomes)),
        failed_at_fault=failed_at_fault,
        seconds=round(time.monotonic() - began, 1),
        notes=notes,
    )


# ---- the admin API, polled -----------------------------------------------------------------------


async def deploy(p: PlatformProcess, model: Path, **fields) -> dict:
    async with httpx.AsyncClient(timeout=deadline(120)) as c:
        r = await c.post(
            f"{p.url}/admin/v1/deployments", json={"name": "tiny", "model": str(model), **fields}
        )
    assert r.status_code in (200, 201), r.text
    return r.json()


async def counts(p: PlatformProcess) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=deadline(10)) as c:
        r = await c.get(f"{p.url}/admin/v1/deployments/tiny")
    r.raise_for_status()
    return r.json()["instances"]


async def until(
    condition: Callable[[], object], what: str, within_s: float = deadline(90), every: float = 0.05
) -> None:
    """Poll `condition` (sync or async) until it is true; TimeoutError naming `what` after `within_s`."""
    end = time.monotonic() + within_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {within_s:g} s")
        await asyncio.sleep(every)


async def at_zero(p: PlatformProcess) -> bool:
    """Scaled to zero: no instance in any state but STOPPED, and no engine process recorded."""
    n = await counts(p)
    return not any(v for state, v in n.items() if state != "STOPPED") and not p.engine_pids()


async def ready(p: PlatformProcess, n: int) -> bool:
    return (await counts(p))["READY"] == n


def processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, command line), from /proc."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            found[int(proc.name)] = (int(fields[1]), cmdline)
    return found


def descendants(pid: int) -> set[int]:
    """The live processes below `pid`: its children, theirs, and so on."""
    table = processes()
    below, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (parent, _) in table.items() if parent in frontier} - below
        below |= frontier
    return below


def engines_of(home: Path) -> set[int]:
    """The live processes whose command line names `home` (engines: their snapshot lies under it),
    whoever started them."""
    return {p for p, (_, cmdline) in processes().items() if str(home) in cmdline}


# ---- the scenarios ---------------------------------------------------------------------------------


async def test_churn_through_scale_to_zero_loses_nothing(platform_factory, tiny_model_dir):
    """Three cycles of: a burst at zero (held, then answered by a cold start), a burst while warm,
    idle past the 1 s idle timeout, scaled to zero. The first and last cycles start from nothing
    left at all; the middle one sends its burst the moment the instance leaves READY, while it
    drains and stops. Every request complete."""
    began = time.monotonic()
    p = platform_factory("--stable-window", "1", "--keepalive-interval", "0.2", "--hold-deadline", flag(90))
    outcomes: list[Outcome] = []
    async with asyncio.timeout(SCENARIO_S):
        await deploy(p, tiny_model_dir, policy="reactive", max=1, idle_timeout_s=1)
        for cycle in range(3):
            if cycle == 1:
                await until(lambda: ready(p, 0), "out of READY after the idle timeout", every=0.02)
            else:
                await until(lambda: at_zero(p), "scaled to zero")
            for size in (6, 4):  # at zero (or scaling to it), then warm
                outcomes += await burst(p.url, size, first=len(outcomes), bound_s=REQUEST_S)
        await until(lambda: at_zero(p), "scaled to zero")
    record(result("churn", "3 cycles of scale to zero", outcomes, began))
    assert not lost(outcomes), describe(outcomes)
    assert tally(outcomes)[COMPLETE] == len(outcomes) == 30
    assert p.metric("stoker_instance_starts_total", deployment="tiny", outcome="ready") >= 3


async def test_sigkill_of_an_instance_under_load(platform_factory, tiny_model_dir):
    """One of two instances SIGKILLed with requests in flight on both. Its streams mid-answer end
    with an SSE error event; everything sent after the kill is complete (a request sent to it before
    the pool noticed fails before its first byte and is retried on the other); it is replaced."""
    began = time.monotonic()
    p = platform_factory("--stable-window", "1")
    async with asyncio.timeout(SCENARIO_S):
        await deploy(p, tiny_model_dir, min_warm=2, max=2, idle_timeout_s=600)
        await until(lambda: ready(p, 2), "two READY instances")
        pids = p.engine_pids()
        victim = sorted(pids)[0]
        async with Load(p.url, concurrency=4, max_tokens=32, bound_s=REQUEST_S) as load:
            await load.wait_finished(6)
            os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            await load.wait_finished(12, since=killed_at)
        await until(
            lambda: not pid_alive(pids[victim]) and victim not in p.engine_pids(), "the killed one forgotten"
        )
        await until(lambda: ready(p, 2), "a replacement READY")
        after = await burst(p.url, 6, bound_s=REQUEST_S)
    outcomes = load.outcomes + after
    record(result("instance SIGKILL", "1 of 2 instances SIGKILLed", outcomes, began))
    assert not lost(outcomes), describe(outcomes)
    assert all(o.kind == COMPLETE for o in outcomes if o.started >= killed_at), describe(outcomes)
    assert all(o.started < killed_at for o in outcomes if o.kind == REFUSED)
    assert {o.instance for o in after} == set(p.engine_pids()) and victim not in p.engine_pids()
    assert p.metric("stoker_instance_restarts_total", deployment="tiny") >= 1


async def test_sigstop_of_an_instance_under_load(platform_factory, tiny_model_dir):
    """One of two instances SIGSTOPped (it takes connections and answers nothing) under load. Probes
    every 0.5 s eject it after two failures; a stream waiting for its headers is retried elsewhere
    after 2 s; a plain request waiting on it is retried when it is ejected; a stream mid-answer on
    it ends with an error event 2 s after the ejection. Nothing lost or hung; after the ejection
    every request goes to the other instance."""
    began = time.monotonic()
    p = platform_factory(*SICK_FLAGS)
    async with asyncio.timeout(SCENARIO_S):
        await deploy(p, tiny_model_dir, min_warm=2, max=2, idle_timeout_s=600)
        await until(lambda: ready(p, 2), "two READY instances")
        pids = p.engine_pids()
        sick, well = sorted(pids)
        try:
            async with Load(p.url, concurrency=4, max_tokens=32, bound_s=REQUEST_S) as load:
                await load.wait_finished(6)
                os.kill(pids[sick], signal.SIGSTOP)
                stopped_at = time.monotonic()
                await until(
                    lambda: p.metric("stoker_instances_ejected", deployment="tiny") == 1, "the ejection"
                )
                ejected_at = time.monotonic()
                await load.wait_finished(12, since=ejected_at)
            after = await burst(p.url, 6, bound_s=REQUEST_S)
        finally:
            os.kill(pids[sick], signal.SIGCONT)
    outcomes = load.outcomes + after
    record(result("instance SIGSTOP", "1 of 2 instances SIGSTOPped", outcomes, began))
    assert not lost(outcomes), describe(outcomes)
    # Only a stream already mid-answer on it when it stopped can end with an error event: its tokens
    # so far reached the client. Everything sent after the stop is complete.
    assert all(o.kind == COMPLETE for o in outcomes if o.started >= stopped_at), describe(outcomes)
    assert all(o.stream and o.instance == sick for o in outcomes if o.kind == REFUSED)
    assert all(o.instance == well for o in outcomes if o.started >= ejected_at)
    # Bounded by the flags: a 2 s headers deadline, or the ejection (two 0.5 s probes) and then 2 s
    # of silence, then a retry; the slowest far below the 300 s first-byte and chunk-gap timeouts
    # that bounded a stopped instance's answers before.
    slowest = max(o.seconds for o in outcomes if o.ended >= stopped_at)
    assert slowest < 30, slowest
    assert set(p.engine_pids()) == {sick, well}  # a stopped engine is not replaced


async def test_a_stream_mid_answer_on_a_stopped_instance_ends_within_the_bounds(
    platform_factory, tiny_model_dir
):
    """The minimal case the SIGSTOP scenario found: a stream whose instance is SIGSTOPped after its
    first token. Probes eject the instance within about a second; the stream must then end (an SSE
    error event: its tokens so far reached the client, so it cannot be retried) within the
    stream-headers bound of silence, not wait out the 300 s allowed between two chunks."""
    p = platform_factory(*SICK_FLAGS)
    async with asyncio.timeout(SCENARIO_S):
        await deploy(p, tiny_model_dir, min_warm=1, max=1, idle_timeout_s=600)
        await until(lambda: ready(p, 1), "a READY instance")
        pids = p.engine_pids()
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        stopped = None
        try:
            async with (
                httpx.AsyncClient(timeout=REQUEST_S) as c,
                c.stream("POST", f"{p.url}/v1/completions", json=body) as r,
            ):
                lines = []
                # Ejection (~1.5 s) + 2 s of silence, on a busy machine.
                async with asyncio.timeout(deadline(30)):
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and stopped is None:
                            stopped = pids[r.headers["x-stoker-instance"]]
                            os.kill(stopped, signal.SIGSTOP)
                        lines.append(line)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
    data = [line for line in lines if line.startswith("data:")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][5:])["error"]["code"] == "upstream_failed"
    assert p.metric("stoker_instance_ejections_total", deployment="tiny") >= 1


async def test_control_plane_sigkill_under_load_and_restart(platform_factory, tiny_model_dir, tmp_path):
    """`stoker up` SIGKILLed with requests in flight, restarted on the same data dir. What was in
    flight fails on the client, counted apart; the restarted platform adopts the first run's READY
    engine (same process, no start), and answers every new request. (Killed with its instance READY:
    a kill while an instance starts is the test below.)"""
    began = time.monotonic()
    home = tmp_path / "home"
    # No warm runtime: engines are told by their command line (`engines_of`), which names the data
    # dir; an engine a runtime became keeps the runtime's.
    flags = ("--stable-window", "1", "--keepalive-interval", "0.2", "--warm-runtimes", "0")
    p = again = platform_factory(*flags, home=home)
    try:
        async with asyncio.timeout(SCENARIO_S):
            await deploy(p, tiny_model_dir, min_warm=1, max=1, idle_timeout_s=600)
            await until(lambda: ready(p, 1), "one READY instance")
            async with Load(p.url, concurrency=4, max_tokens=32, bound_s=REQUEST_S) as load:
                await load.wait_finished(6)
                first_run = descendants(p.proc.pid) | set(p.engine_pids().values())
                engines = set(p.engine_pids().values())
                p.proc.kill()
                killed_at = time.monotonic()
                load.stop()
            p.proc.wait(timeout=deadline(30))
            first_run |= engines_of(home)  # an engine spawned between the look and the kill, if any
            before = [o for o in load.outcomes if o.ended < killed_at]
            at_kill = [o for o in load.outcomes if o.ended >= killed_at]

            again = platform_factory(*flags, home=home)
            await until(lambda: ready(again, 1), "the deployment back")
            assert set(again.engine_pids().values()) == engines  # adopted: the same engine process
            assert engines_of(home) == engines  # and nothing else runs on this data dir
            assert again.metric("stoker_instance_starts_total", outcome="ready") == 0  # no cold start
            async with Load(again.url, concurrency=4, max_tokens=32, bound_s=REQUEST_S) as load2:
                await load2.wait_finished(12)
    finally:
        stop_strays(home, again)
    cut = [o for o in at_kill if o.kind != COMPLETE]
    outcomes = before + [o for o in at_kill if o.kind == COMPLETE] + load2.outcomes
    record(
        result(
            "control plane SIGKILL",
            "`stoker up` SIGKILLed under load, restarted",
            outcomes,
            began,
            failed_at_fault=len(cut),
            notes=f"{len(first_run)} process(es) of the first run; its READY engine adopted, no start",
        )
    )
    assert first_run
    assert not lost(outcomes), describe(outcomes)
    assert all(o.kind == COMPLETE for o in load2.outcomes), describe(load2.outcomes)
    # What the kill ended failed as a client sees a dead server: the connection, not a bad answer.
    assert all(o.transport_error for o in cut), describe(cut)


# Loaded into `stoker up` only (PYTHONPATH): the instance record's write takes `delay` seconds, as
# an fsync on a busy disk may. `put` is synchronous, so the whole control plane waits meanwhile,
# with the engine process already spawned and not yet recorded.
SLOW_RECORDS = """
import os, sys, time
if sys.argv[1:2] == ["up"] and os.environ.get("STOKER_TEST_RECORD_DELAY_S"):
    from warm_pool.backends import records

    def put(self, record, _put=records.InstanceRecords.put):
        time.sleep(float(os.environ["STOKER_TEST_RECORD_DELAY_S"]))
        _put(self, record)

    records.InstanceRecords.put = put
"""


async def test_control_plane_killed_between_spawning_an_engine_and_recording_it(
    platform_factory, tiny_model_dir, tmp_path
):
    """Found by the control-plane scenario on a busy machine (it killed `stoker up` while a second
    instance started): an engine of the first run still ran after the restart, and ran on for good
    (fixed: `records.marked`). Here the window is held open (the record's write takes 60 s) so the kill lands in it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_RECORDS)
    home = tmp_path / "home"
    env = {"PYTHONPATH": str(hook), "STOKER_TEST_RECORD_DELAY_S": "60"}
    p = again = platform_factory("--warm-runtimes", "0", home=home, env=env)  # engines told by command line
    try:
        async with asyncio.timeout(SCENARIO_S):
            deploying = asyncio.ensure_future(
                deploy(p, tiny_model_dir, min_warm=1, max=1, idle_timeout_s=600)
            )
            await until(lambda: engines_of(home) and not p.engine_pids(), "an engine spawned, not recorded")
            orphan = engines_of(home)
            p.proc.kill()
            p.proc.wait(timeout=deadline(30))
            deploying.cancel()
            # Up: its start-up has stopped what the records name.
            again = platform_factory("--warm-runtimes", "0", home=home)
            # Never named in a record, it is found by the owner mark in its environment.
            await until(
                lambda: not any(pid_alive(pid) for pid in orphan), "the orphan stopped", within_s=deadline(5)
            )
    finally:
        stop_strays(home, again)


def stop_strays(home: Path, *platforms: PlatformProcess) -> None:
    """SIGKILL every engine on `home` that none of the live `platforms` owns: a failed test's
    leftovers, not left running on a shared machine. (The fixture stops the platforms themselves.)"""
    owned = set()
    for p in platforms:
        if p.proc is not None and p.proc.poll() is None:
            owned |= descendants(p.proc.pid)
    for pid in engines_of(home) - owned:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


async def test_a_full_hold_queue_refuses_exactly_the_excess(platform_factory, tiny_model_dir):
    """Ten requests at once at zero with `--max-queued 3`: three held and answered by the cold
    start, seven refused at once with 503, Retry-After and OpenAI's error object (code queue_full),
    every refusal before the first answer."""
    began = time.monotonic()
    p = platform_factory("--max-queued", "3", "--hold-deadline", flag(90), "--keepalive-interval", "0.2")
    async with asyncio.timeout(SCENARIO_S):
        await deploy(p, tiny_model_dir, max=1, idle_timeout_s=600)
        outcomes = await burst(p.url, 10, bound_s=REQUEST_S)
        then = await burst(p.url, 6, bound_s=REQUEST_S, first=10)  # READY now: nothing held, all served
    record(result("full hold queue", "10 at zero, --max-queued 3", outcomes + then, began))
    assert not lost(outcomes + then), describe(outcomes + then)
    refused = [o for o in outcomes if o.kind == REFUSED]
    held = [o for o in outcomes if o.kind == COMPLETE]
    assert (len(held), len(refused)) == (3, 7)
    assert {o.reason for o in refused} == {"503 queue_full"}
    assert max(o.ended for o in refused) < min(o.ended for o in held)
    assert all(o.kind == COMPLETE for o in then)
