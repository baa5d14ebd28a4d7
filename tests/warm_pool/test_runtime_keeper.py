"""The warm-runtime keeper (`warm_pool.runtimes`) on real processes of a minimal runtime kind, its
pure decisions as tables, the tier a start is counted in, the arbiter counting runtimes' memory,
and the simulator's warm runtimes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.deadlines import ENGINE_START, deadline
from tests.warm_pool.rig import at
from warm_pool.arbiter import Device, Wish, arbitrate
from warm_pool.backends.base import runtime_ready, start_tier
from warm_pool.backends.local import LocalBackend
from warm_pool.backends.procs import ProcessHandle
from warm_pool.census import Member
from warm_pool.launch import LaunchSpec
from warm_pool.policies.base import ScalingConfig, Tier, TierTimes
from warm_pool.policies.settings import bind_policy
from warm_pool.profiles import InstanceModel
from warm_pool.runtimes import Runtime, RuntimeKeeper, RuntimeKind, RuntimeMetrics, memory_of, to_start
from warm_pool.simulate import simulate
from warm_pool.trace import TraceRequest

from .support import pid_gone, wait_gone

if sys.platform != "linux":  # pragma: no cover
    pytest.skip("runtimes need Linux's /proc", allow_module_level=True)

# A runtime as small as one can be (the keeper appends `--socket-dir DIR`): it serves one handoff
# with the shared protocol and exits 0.
RUNTIME = """
import os, sys
from pathlib import Path
from warm_pool.handoff import TOKEN_ENV, HandoffError, listen, serve_one, take_over
listener = listen(Path(sys.argv[-1]))
try:
    handoff, conn, log_fd = serve_one(listener, os.environ.pop(TOKEN_ENV))
except HandoffError as exc:
    sys.exit(2)
take_over(handoff, conn, log_fd, listener)
print("became", " ".join(handoff.argv), flush=True)
"""
# A runtime that forks its successor at each handoff (`warm_pool.succession.become_engine`); as "its
# engine" it prints who it is, the PID it was born as (a forked successor was born in its first
# ancestor: memory is copied, so `born` is that one's PID) and what of the handoff's environment it has.
FORKING_RUNTIME = """
import os, sys, time
from pathlib import Path
from warm_pool.handoff import TOKEN_ENV, HandoffError, listen
from warm_pool.succession import become_engine
born = os.getpid()
listener = listen(Path(sys.argv[-1]))
try:
    handoff = become_engine(listener, os.environ.pop(TOKEN_ENV), forks=True)
except HandoffError:
    sys.exit(2)
secrets = ",".join(sorted(k for k in os.environ if k.startswith("SECRET_")))
print("became", handoff.argv[-1], "pid", os.getpid(), "born", born, "secrets", secrets, flush=True)
time.sleep(float(os.environ.get("LINGER", "0")))
"""
ENGINE_SPEC = LaunchSpec(("stoker", "engine", "--port", "1"), env={"STOKER_ENGINE_API_KEY": "k"})


def kind(count: int, command: tuple[str, ...] = (sys.executable, "-c", RUNTIME)) -> RuntimeKind:
    return RuntimeKind("cpu", command, count)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def until(condition, within_s: float = ENGINE_START, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while not condition():
        assert loop.time() < end, f"{what} not reached in {within_s:g} s"
        await asyncio.sleep(0.02)


def gauge(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_the_keeper_keeps_its_runtimes_refills_after_a_take_and_stops_them_all(tmp_path):
    registry = CollectorRegistry()
    clock = Clock()
    keeper = RuntimeKeeper(
        [kind(2)],
        tmp_path / "logs",
        metrics=RuntimeMetrics(registry),
        clock=clock,
        interval_s=0.05,
        memory_interval_s=0.0,
        refill_delay_s=5.0,
    )
    keeper.start()
    try:
        await until(lambda: keeper.ready("cpu") == 2, what="two runtimes ready")
        first = {r["pid"] for r in keeper.status()}
        await until(lambda: all(r["pss_bytes"] > 0 for r in keeper.status()), what="memory measured")
        assert gauge(registry, "stoker_warm_runtimes", engine="cpu") == 2
        assert gauge(registry, "stoker_warm_runtime_memory_bytes", engine="cpu", kind="rss") > 0
        assert keeper.take(LaunchSpec(("vllm", "serve", "m"), program="vllm")) is None  # not its kind
        rt = keeper.take(ENGINE_SPEC)
        assert rt is not None and rt.handle.pid in first and rt.handle.from_runtime
        handle = await keeper.hand_off(rt, ENGINE_SPEC, tmp_path / "engine.log")
        assert handle.pid == rt.handle.pid
        assert await rt.process.wait() == 0
        assert (tmp_path / "engine.log").read_text() == "became engine --port 1\n"
        for _ in range(5):  # the refill waits 5 s of the keeper's clock, which stands still
            await asyncio.sleep(0.05)
            assert len(keeper.status()) == 1
        clock.now = 5.0
        await until(lambda: keeper.ready("cpu") == 2, what="the taken runtime replaced")
        now = {r["pid"] for r in keeper.status()}
        assert len(now - first) == 1 and rt.handle.pid not in now
        dirs = [Path(r.directory) for r in keeper._runtimes.values()]
    finally:
        await keeper.aclose()
    for pid in now:
        assert await wait_gone(pid), f"runtime {pid} still runs after aclose"
    assert not any(d.exists() for d in dirs)
    assert gauge(registry, "stoker_warm_runtimes", engine="cpu") == 0


async def test_a_kind_added_later_is_kept_too(tmp_path):
    keeper = RuntimeKeeper([kind(0)], tmp_path / "logs", interval_s=0.05)
    keeper.start()  # nothing to keep yet
    try:
        other = RuntimeKind("vllm", (sys.executable, "-c", RUNTIME), 1, program="vllm", first_args=("serve",))
        keeper.add_kind(other)
        with pytest.raises(ValueError, match="kept already"):
            keeper.add_kind(other)
        await until(lambda: keeper.ready("vllm") == 1, what="the added kind's runtime ready")
        assert keeper.take(ENGINE_SPEC) is None  # a CPU-engine launch: not its kind
        taken = keeper.take(LaunchSpec(("vllm", "serve", "m"), program="vllm"))
        assert taken is not None
        taken.process.kill()  # taken and not handed off: the taker's to stop
        await taken.process.wait()
    finally:
        await keeper.aclose()


async def test_a_kind_with_a_python_path_starts_its_runtimes_with_it_and_takes_launches_needing_it(tmp_path):
    script = RUNTIME + "print('path', os.environ['PYTHONPATH'].split(os.pathsep)[0], flush=True)\n"
    guarded = RuntimeKind("vllm", (sys.executable, "-c", script), 1, program="vllm", first_args=("serve",),
                          python_path=("/opt/guard",))  # fmt: skip
    keeper = RuntimeKeeper([guarded], tmp_path / "logs", interval_s=0.05)
    keeper.start()
    try:
        await until(lambda: keeper.ready("vllm") == 1, what="a runtime ready")
        needs = LaunchSpec(("vllm", "serve", "m"), program="vllm", python_path=("/opt/guard",))
        assert not RuntimeKind("vllm", ("x",), 1, program="vllm", first_args=("serve",)).takes(needs)
        rt = keeper.take(needs)
        assert rt is not None
        await keeper.hand_off(rt, needs, tmp_path / "engine.log")
        assert await rt.process.wait() == 0
        assert (tmp_path / "engine.log").read_text() == "became serve m\npath /opt/guard\n"
    finally:
        await keeper.aclose()


async def test_a_runtime_that_dies_is_replaced_after_the_backoff(tmp_path):
    clock = Clock()
    keeper = RuntimeKeeper([kind(1)], tmp_path / "logs", clock=clock, interval_s=0.05)
    keeper.start()
    try:
        await until(lambda: keeper.ready("cpu") == 1, what="a runtime ready")
        [victim] = [r["pid"] for r in keeper.status()]
        os.kill(victim, signal.SIGKILL)
        await until(lambda: victim not in {r["pid"] for r in keeper.status()}, what="the dead one dropped")
        for _ in range(10):  # the clock stands still: the backoff (1 s) is not over
            await asyncio.sleep(0.05)
            assert keeper.status() == []
        clock.now = 1.0
        await until(lambda: keeper.ready("cpu") == 1, what="its replacement ready")
    finally:
        await keeper.aclose()


async def test_a_runtime_that_cannot_start_backs_off_longer_each_time(tmp_path):
    clock = Clock()
    broken = kind(1, (sys.executable, "-c", "import sys; sys.exit(3)"))
    logs = tmp_path / "logs"
    keeper = RuntimeKeeper([broken], logs, clock=clock, interval_s=0.02)
    keeper.start()
    try:
        # (spawn number, when it is spawned, when the next may be): backoffs of 1, 2, 4 s.
        for spawned, at_s, next_s in ((1, 0.0, 1.0), (2, 1.0, 3.0), (3, 3.0, 7.0)):
            clock.now = at_s
            await until(lambda n=spawned: len(list(logs.glob("*.log"))) == n, what=f"spawn {spawned}")
            # Its failure recorded (the backoff counts from then). Not `status() == []`: the log file
            # exists before the spawn registers the runtime, so an empty status can come first, and a
            # loaded machine then records the failure after the clock below moved.
            await until(lambda n=spawned: keeper._failures[broken.engine] == n, what="its failure seen")
            clock.now = next_s - 0.01
            for _ in range(5):
                await asyncio.sleep(0.05)
                assert len(list(logs.glob("*.log"))) == spawned, "spawned again before its backoff ended"
    finally:
        await keeper.aclose()


async def test_the_local_backend_starts_an_instance_in_a_runtime(tmp_path):
    keeper = RuntimeKeeper([kind(1)], tmp_path / "runtimes", interval_s=0.05)
    backend = LocalBackend(tmp_path / "logs", runtimes=keeper)
    assert await backend.running() == []  # also starts the keeper
    try:
        await until(lambda: runtime_ready(backend, "cpu"), what="a runtime ready")
        [pid] = [r["pid"] for r in keeper.status()]
        handle = await backend.start(at("tiny-0a1b2c3d", 1), ENGINE_SPEC)
        assert handle.pid == handle.pgid == pid and handle.from_runtime
        assert handle.instance_id == "tiny-0a1b2c3d"
        await until(lambda: not backend.is_alive(handle), what="its 'engine' done")
        assert "became engine --port 1" in backend.log_path("tiny-0a1b2c3d").read_text()
        # Its exit status: reaped as a child.
        assert await backend.stop(handle, term_timeout_s=deadline(10)) == 0
        assert not runtime_ready(backend, "vllm")
    finally:
        await backend.aclose()
    assert all(pid_gone(r["pid"]) for r in keeper.status())
    assert keeper.status() == []


@pytest.mark.parametrize(
    ("count", "live", "now", "not_before", "spawn"),
    [
        (1, 0, 0.0, 0.0, 1),
        (2, 1, 5.0, 0.0, 1),
        (2, 2, 5.0, 0.0, 0),
        (1, 3, 5.0, 0.0, 0),  # more than asked (a count lowered): none now, none stopped
        (1, 0, 5.0, 6.0, 0),  # backing off
        (0, 0, 5.0, 0.0, 0),  # the tier off
    ],
)
def test_how_many_runtimes_to_start(count, live, now, not_before, spawn):
    assert to_start(count, live, now, not_before) == spawn


@pytest.mark.parametrize(
    ("snapshot", "from_runtime", "tier"),
    [
        (Tier.PAGE_CACHE, True, Tier.RUNTIME),
        (Tier.DISK, True, Tier.RUNTIME),
        (Tier.OBJECT_STORAGE, True, Tier.OBJECT_STORAGE),
        (Tier.PAGE_CACHE, False, Tier.PAGE_CACHE),
        (Tier.DISK, False, Tier.DISK),
    ],
)
def test_the_tier_of_a_start(snapshot, from_runtime, tier):
    assert start_tier(snapshot, from_runtime) is tier


def test_memory_is_read_from_smaps_rollup(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "smaps_rollup").write_text(
        "00400000-7ffd r--p 00000000 00:00 0 [rollup]\nRss:  402312 kB\nPss:  265000 kB\nShared_Clean: 1 kB\n"
    )
    assert memory_of(42, proc=tmp_path) == (402312 * 1024, 265000 * 1024)
    assert memory_of(43, proc=tmp_path) is None
    rss, pss = memory_of(os.getpid())
    assert rss >= pss > 0


def test_a_start_without_a_figure_of_its_own_counts_as_a_page_cache_start():
    assert TierTimes(page_cache=7.0).runtime == 7.0
    assert TierTimes(page_cache=7.0, runtime=1.5).of("runtime") == 1.5


def test_the_arbiter_counts_what_runtimes_hold_on_a_device():
    wish = Wish("chat", ready=1, sleeping=0, awake_bytes=600, asleep_bytes=100, rate=1.0, held=1)
    devices = [Device("cpu0", 1000)]
    assert arbitrate([wish], [], devices)["chat"].ready == 1
    runtime = Member("cpu-1a2b", "(warm runtimes)", "cpu0", False, holds=500)
    grant = arbitrate([wish], [runtime], devices)["chat"]
    assert grant.ready == 0 and grant.denied == 1  # 600 more do not fit beside the runtime's 500


def test_the_keeper_shows_its_runtimes_to_the_fleet(tmp_path):
    gpu = RuntimeKind("vllm", ("true",), 1, program="vllm", device="gpu0", device_bytes=768 << 20)
    keeper = RuntimeKeeper([kind(1), gpu], tmp_path)
    assert keeper.fleet_wish() is None and keeper.fleet_members() == []
    keeper.host_device = "cpu0"

    for ident, k, pss in (("cpu-1", kind(1), 300 << 20), ("vllm-1", gpu, 200 << 20)):
        handle = ProcessHandle(1, 1, 1, from_runtime=True)
        keeper._runtimes[ident] = Runtime(
            ident, k, None, handle, tmp_path, "t", {}, tmp_path / "x", 0.0, pss=pss
        )
    holds = {(m.id, m.device): m.holds for m in keeper.fleet_members()}
    assert holds == {
        ("cpu-1", "cpu0"): 300 << 20,
        ("vllm-1", "gpu0"): 768 << 20,
        ("vllm-1", "cpu0"): 200 << 20,
    }


def test_the_simulator_starts_from_a_warm_runtime_and_refills_it():
    trace = tuple(TraceRequest(t, 10, 10) for t in (0.0, 30.0, 31.0, 200.0))
    scaling = ScalingConfig(max=2, idle_timeout_s=10.0, stable_window_s=5.0)
    times = TierTimes(wake=1.0, page_cache=8.0, disk=9.0, object_storage=20.0, runtime=2.0)

    def run(runtimes: int):
        model = InstanceModel(
            startup=times, warm_runtimes=runtimes, jitter=0.0, can_sleep=False, runtime_refill_s=6.0
        )
        return simulate(trace, bind_policy("reactive", scaling), scaling=scaling, model=model)

    without, with_one = run(0), run(1)
    assert without.runtime_starts == 0 and with_one.runtime_starts >= 2  # refilled between starts
    assert with_one.p99_wait_s < without.p99_wait_s


def forking_kind(count: int = 1, script: str = FORKING_RUNTIME) -> RuntimeKind:
    return RuntimeKind("cpu", (sys.executable, "-c", script), count, forks=True)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


async def test_a_burst_of_starts_each_takes_a_successor_forked_at_the_previous_handoff(tmp_path):
    clock = Clock()  # stands still: no runtime is spawned after the first but by a fork
    keeper = RuntimeKeeper([forking_kind()], tmp_path / "logs", clock=clock, interval_s=0.05)
    backend = LocalBackend(tmp_path / "engines", runtimes=keeper)
    await backend.running()
    try:
        await until(lambda: keeper.ready("cpu") == 1, what="the first runtime ready")
        [first] = [r["pid"] for r in keeper.status()]

        def spec(i: int) -> LaunchSpec:
            env = {f"SECRET_{i}": "key", "LINGER": "30"}
            return LaunchSpec(("stoker", "engine", f"d{i}"), env=env)

        handles = await asyncio.gather(*(backend.start(at(f"d{i}-0a1b2c3d", 1), spec(i)) for i in range(4)))
        assert all(h.from_runtime for h in handles)
        pids = [h.pid for h in handles]
        assert len(set(pids)) == 4 and first in pids
        for h in handles:  # each in a process group of its own, a child of this process (the keeper)
            assert h.pgid == h.pid == os.getpgid(h.pid)
            assert parent_of(h.pid) == os.getpid()
        [(successor, waiting)] = [(r["pid"], r["state"]) for r in keeper.status()]
        assert waiting == "ready" and successor not in pids and parent_of(successor) == os.getpid()
        assert os.getpgid(successor) == successor  # in no engine's group: stopping one leaves it
        for i, h in enumerate(handles):
            log = await _line(backend.log_path(f"d{i}-0a1b2c3d"))
            # Born in the first runtime (forked), never a fresh process; the handoff's environment
            # is its own, not what its ancestor was handed (forked before the ancestor took it over).
            assert log == f"became d{i} pid {h.pid} born {first} secrets SECRET_{i}"
        codes = await asyncio.gather(*(backend.stop(h, term_timeout_s=deadline(10)) for h in handles))
        assert codes == [-signal.SIGTERM] * 4  # each reaped here with its real status
        assert all(pid_gone(pid) for pid in pids)
        assert keeper.status()[0]["pid"] == successor  # stopping the engines left it
    finally:
        await backend.aclose()
    assert await wait_gone(successor)


async def test_a_successor_that_dies_is_reaped_and_replaced(tmp_path):
    keeper = RuntimeKeeper([forking_kind()], tmp_path / "logs", interval_s=0.05, refill_delay_s=0.0)
    keeper.start()
    try:
        await until(lambda: keeper.ready("cpu") == 1, what="the first runtime ready")
        rt = keeper.take(ENGINE_SPEC)
        await keeper.hand_off(rt, ENGINE_SPEC, tmp_path / "engine.log")
        assert await rt.process.wait() == 0
        [successor] = [r["pid"] for r in keeper.status()]
        os.kill(successor, signal.SIGKILL)
        await until(lambda: successor not in {r["pid"] for r in keeper.status()}, what="the dead one dropped")
        assert not _text(Path(f"/proc/{successor}/stat"))  # reaped: not even a zombie is left
        await until(lambda: keeper.ready("cpu") == 1, what="a fresh runtime in its place")
    finally:
        await keeper.aclose()


async def test_a_runtime_that_does_not_fork_is_replaced_after_the_refill_delay(tmp_path):
    clock = Clock()
    keeper = RuntimeKeeper(
        [forking_kind(script=RUNTIME)], tmp_path / "logs", clock=clock, interval_s=0.05, refill_delay_s=5.0
    )
    keeper.start()
    try:
        await until(lambda: keeper.ready("cpu") == 1, what="the first runtime ready")
        rt = keeper.take(ENGINE_SPEC)
        await keeper.hand_off(rt, ENGINE_SPEC, tmp_path / "engine.log")  # answered without a successor
        assert await rt.process.wait() == 0
        assert keeper.status() == [] and await keeper.take_soon(ENGINE_SPEC) is None  # nothing due
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == []  # the successor's log gone
        clock.now = 5.0
        await until(lambda: keeper.ready("cpu") == 1, what="the replacement")
    finally:
        await keeper.aclose()


async def _line(path: Path) -> str:
    await until(lambda: _text(path).endswith("\n"), what=f"a line in {path.name}")
    return _text(path).strip()


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# A runtime whose imports last until the test says (it listens once `gate` exists).
GATED_RUNTIME = (
    """
import os, sys, time
from pathlib import Path
gate = Path(os.environ["GATE"])
while not gate.exists():
    time.sleep(0.01)
"""
    + RUNTIME
)


async def test_a_start_waits_for_a_runtime_still_importing_rather_than_spawning_beside_it(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("GATE", str(tmp_path / "gate"))
    keeper = RuntimeKeeper([forking_kind(script=GATED_RUNTIME)], tmp_path / "logs", interval_s=0.05)
    keeper.start()
    try:
        await until(lambda: len(keeper.status()) == 1, what="a runtime starting")
        [(starting, state)] = [(r["pid"], r["state"]) for r in keeper.status()]
        assert state == "starting"
        # One that cannot fit it (a variable read at start differs) is not waited for.
        assert await keeper.take_soon(LaunchSpec(ENGINE_SPEC.argv, env={"CUDA_VISIBLE_DEVICES": "7"})) is None
        waiting = asyncio.create_task(keeper.take_soon(ENGINE_SPEC))
        for _ in range(10):  # it cannot finish while the runtime has not listened
            await asyncio.sleep(0.05)
            assert not waiting.done()
        (tmp_path / "gate").touch()
        rt = await asyncio.wait_for(waiting, deadline(60))
        assert rt is not None and rt.handle.pid == starting
        await keeper.hand_off(rt, ENGINE_SPEC, tmp_path / "engine.log")
        assert await rt.process.wait() == 0
    finally:
        await keeper.aclose()


# As "its engine", it starts a child of its own (in its process group) and says its PID.
PARENT_RUNTIME = (
    RUNTIME.replace('print("became", " ".join(handoff.argv), flush=True)', "")
    + """
import subprocess, time
child = subprocess.Popen(["sleep", "300"])
print("child", child.pid, flush=True)
time.sleep(300)
"""
)


async def test_an_engines_orphaned_child_is_reaped_by_the_subreaper(tmp_path):
    keeper = RuntimeKeeper(
        [forking_kind(script=PARENT_RUNTIME)], tmp_path / "logs", interval_s=0.05, memory_interval_s=0.0
    )
    keeper.start()
    try:
        await until(lambda: keeper.ready("cpu") == 1, what="the first runtime ready")
        rt = keeper.take(ENGINE_SPEC)
        handle = await keeper.hand_off(rt, ENGINE_SPEC, tmp_path / "engine.log")
        child = int((await _line(tmp_path / "engine.log")).split()[1])
        assert os.getpgid(child) == handle.pgid  # in the engine's group
        os.killpg(handle.pgid, signal.SIGKILL)  # the engine's group stopped: its child is orphaned here
        assert await rt.process.wait() == -signal.SIGKILL
        await until(lambda: not _text(Path(f"/proc/{child}/stat")), what="the orphan reaped, not a zombie")
    finally:
        await keeper.aclose()


async def test_an_on_demand_kind_keeps_none_before_a_deployment_of_its_engine_wants_it(tmp_path):
    kind = RuntimeKind("cpu", (sys.executable, "-c", RUNTIME), 1, on_demand=True)
    keeper = RuntimeKeeper([kind], tmp_path / "logs", interval_s=0.05)
    keeper.start()
    try:
        for _ in range(10):  # its loop runs, and spawns nothing
            await asyncio.sleep(0.05)
            assert keeper.status() == [] and keeper.kept(kind) == 0
        assert await keeper.take_soon(ENGINE_SPEC) is None  # none on its way: a fresh start
        keeper.want("vllm")  # another engine's deployment
        await asyncio.sleep(0.2)
        assert keeper.status() == []
        keeper.want("cpu")
        await until(lambda: keeper.ready("cpu") == 1, what="a runtime once a CPU deployment exists")
        assert keeper.kept(kind) == 1
    finally:
        await keeper.aclose()
