"""Faults on the split planes under load: a controller, two gateways, real CPU engines on loopback.

The traffic is `reliability_support.Load` (the single box's reliability suite drives the same):
plain and streamed requests from four clients, spread over both gateways as a load balancer
spreads them. A connection a gateway refused never reached it and goes to the other (`unreached`);
a request cut on the wire under a gateway that died is counted apart (`failed_at_fault`) and the
client's retry on the other gateway is an outcome of its own. The promise in every scenario: no
request that reached a surviving gateway is lost, and a deployment at zero scales up afterwards.

| scenario | fault | promise |
|---|---|---|
| gateway stopped | SIGTERM to one gateway under load | none lost: its in-flight requests finish, new ones go to the other |
| gateway killed | SIGKILL to one gateway under load | only requests in flight on it fail (counted); each one's retry on the other completes |
| controller killed mid-canary | SIGKILL while the canary revision starts, restarted on its data dir | none lost; the canary resumes and takes its share; every revision with traffic serving |
| controller stopped | SIGSTOP past the gateways' staleness bound, then SIGCONT | warm traffic all complete; a request at zero held, then refused with Retry-After; all recovers |
| network cut | the gateways' link to the controller black-holed, then healed | warm traffic all complete; a deployment made during the cut reaches the gateways after it |
| engines during a switch | one engine SIGKILLed, another SIGSTOPped, while a new revision takes over | none lost; the new revision serves all, no old engine left |

Every interval comes from a flag (staleness, report interval, hold deadline, probes); every wait
polls with a deadline from `tests/deadlines.py`. The rows are printed and written as JSON to
$STOKER_PLANE_FAULTS_OUT when set (docs/operations/planes.md's table is made from them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import build_tiny_model
from tests.deadlines import COLD_ANSWER, deadline, flag
from tests.platform.conftest import PlatformProcess, pid_alive
from tests.platform.engine.conftest import free_port
from tests.platform.relays import CutRelay
from tests.platform.reliability_support import (
    COMPLETE,
    LOST,
    REFUSED,
    SICK_FLAGS,
    Load,
    Outcome,
    ScenarioResult,
    describe,
    lost,
    send,
    tally,
    write_results,
)

ADMIN = "admin-key-for-plane-faults"
ENV = {"STOKER_ADMIN_KEY": ADMIN}
H = {"authorization": f"Bearer {ADMIN}"}
SCENARIO_S = deadline(240)  # a hard bound on a whole scenario, its engine starts included
REQUEST_S = deadline(60)  # one request's bound: past it, it is a hang (counted lost)
STALE_S = 3  # --gateway-stale-after: a gateway silent this long is no longer counted
# A killed gateway's last load counts for the silent grace (its requests may be alive behind a
# cut): the final drain waits that long for them, so the grace here is the staleness bound's 10x
# cut to what the scenarios' cuts need.
# No warm runtime: the canary and the revision switch fault engines while they start, and a start
# through a runtime (a fork, then the weights) can be READY before the fault lands.
CONTROLLER_FLAGS = (
    "--stable-window", "1",
    "--gateway-stale-after", str(STALE_S),
    "--gateway-silent-grace", "20s",
    "--stop-instances-on-exit",
    "--warm-runtimes", "0",
)  # fmt: skip
RESULTS: list[ScenarioResult] = []


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    write_results("plane faults", RESULTS, "STOKER_PLANE_FAULTS_OUT")


@dataclass
class Planes:
    """A controller and its gateways, each a real process; `started` are stopped at the end."""

    tmp: Path
    controller: PlatformProcess
    gateway_flags: tuple[str, ...]
    controller_url: str  # what the gateways are told (the controller, or a relay in front of it)
    gateways: list[PlatformProcess] = field(default_factory=list)
    started: list[PlatformProcess] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gateways]

    def gateway(self, i: int, port: int | None = None) -> PlatformProcess:
        g = PlatformProcess(
            self.tmp / f"gw{i}",
            port or free_port(),
            ("--controller", self.controller_url, "--gateway-id", f"gw-{i}", *self.gateway_flags),
            extra_env=ENV,
            command="gateway",
        ).start()
        self.started.append(g)
        return g

    def restart_controller(self) -> PlatformProcess:
        """A new controller process on the same data dir and port."""
        c = self.controller
        self.controller = PlatformProcess(c.home, c.port, c.args, extra_env=ENV, command="controller").start()
        self.started.append(self.controller)
        return self.controller


@pytest.fixture
def make_planes(tmp_path: Path):
    made: list[Planes] = []

    def make(
        *gateway_flags: str, controller_url: Callable[[int], str] | None = None, gateways: int = 2
    ) -> Planes:
        controller = PlatformProcess(
            tmp_path / "home", free_port(), CONTROLLER_FLAGS, extra_env=ENV, command="controller"
        ).start()
        flags = ("--report-interval", "0.2s", "--hold-deadline", flag(120), *gateway_flags)
        url = controller_url(controller.port) if controller_url else controller.url
        planes = Planes(tmp_path, controller, flags, url, started=[controller])
        made.append(planes)
        planes.gateways = [planes.gateway(i) for i in range(gateways)]
        return planes

    yield make
    for planes in made:
        for p in reversed(planes.started):
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)  # one a failed test left stopped answers SIGTERM
            p.stop()


# ---- the admin API and the requests, async so that the load runs on meanwhile ------------------------


async def deploy(url: str, name: str, model: Path, **fields) -> dict:
    async with httpx.AsyncClient(timeout=deadline(120), headers=H) as c:
        r = await c.post(f"{url}/admin/v1/deployments", json={"name": name, "model": str(model), **fields})
    assert r.status_code in (200, 201), r.text
    return r.json()


async def get(url: str, path: str) -> dict:
    async with httpx.AsyncClient(timeout=deadline(30), headers=H) as c:
        r = await c.get(url + path)
    r.raise_for_status()
    return r.json()


async def until(condition: Callable[[], object], what: str, within_s: float = deadline(120)) -> None:
    """Poll `condition` (sync or async; an HTTP error counts as false) until true, or TimeoutError."""
    end = time.monotonic() + within_s
    last = "never checked"
    while True:
        try:
            value = condition()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            last = "false"
        except (httpx.HTTPError, KeyError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {within_s:g} s (last: {last})")
        await asyncio.sleep(0.1)


async def ready(url: str, name: str, n: int = 1) -> bool:
    return (await get(url, f"/admin/v1/deployments/{name}"))["instances"]["READY"] == n


async def routed(gateway: str, name: str) -> bool:
    """The gateway has the deployment in its table (its /v1/models lists it)."""
    return any(m["id"] == name for m in (await get(gateway, "/v1/models"))["data"])


async def one(url: str, model: str, *, stream: bool = False, bound_s: float = COLD_ANSWER) -> Outcome:
    """One chat request, classified."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": stream,
    }
    async with httpx.AsyncClient(timeout=bound_s) as c:
        return await send(c, url, "/v1/chat/completions", body, stream, bound_s, H)


async def scales_from_zero(planes: Planes, model: Path, name: str = "z") -> Outcome:
    """A deployment at zero, made now, answers its first request through a live gateway."""
    await deploy(planes.urls[0], name, model, min_warm=0, max=1, idle_timeout_s=600)
    for g in planes.urls:
        await until(lambda g=g: routed(g, name), f"{name} in {g}'s table")
    return await one(planes.urls[-1], name)


def row(scenario: str, fault: str, outcomes: list[Outcome], began: float, **extra) -> ScenarioResult:
    counts = tally(outcomes)
    failed = extra.pop("failed_at_fault", 0)
    r = ScenarioResult(
        scenario,
        fault,
        requests=len(outcomes),
        complete=counts[COMPLETE],
        refused=counts[REFUSED],
        lost=counts[LOST] - failed,
        failed_at_fault=failed,
        seconds=round(time.monotonic() - began, 1),
        **extra,
    )
    RESULTS.append(r)
    print(f"\n{r.as_dict()}")
    return r


def load(planes: Planes, **kw) -> Load:
    return Load(planes.urls, concurrency=4, max_tokens=24, bound_s=REQUEST_S, model="m", headers=H, **kw)


# ---- the scenarios --------------------------------------------------------------------------------


async def test_a_gateway_stopped_then_one_killed_under_load(make_planes, tiny_model_dir: Path) -> None:
    """SIGTERM to gw-0 under load: its in-flight requests finish, new connections go to gw-1, none
    lost. gw-0 restarted under its id takes traffic again. Then SIGKILL to gw-1: only the requests
    in flight on it fail, on the wire, and each one's retry on gw-0 completes."""
    began = time.monotonic()
    planes = make_planes()
    a, b = planes.gateways
    async with asyncio.timeout(SCENARIO_S):
        await deploy(a.url, "m", tiny_model_dir, min_warm=1, max=1, idle_timeout_s=600)
        await until(lambda: ready(planes.controller.url, "m"), "m READY")
        for g in planes.urls:
            await until(lambda g=g: routed(g, "m"), f"m in {g}'s table")
        async with load(planes, retry_elsewhere=True) as traffic:
            await traffic.wait_finished(8)
            stopped_at = traffic.mark("gw-0 stopping")
            a.proc.send_signal(signal.SIGTERM)
            await until(lambda: a.proc.poll() is not None, "gw-0 exited", deadline(60))
            assert a.proc.returncode == 0, a.log_tail()
            traffic.mark("gw-0 gone")
            await traffic.wait_finished(8, since=time.monotonic())
            # Back under its id on its port: traffic reaches it again.
            again = planes.gateway(0, port=a.port)
            planes.gateways[0] = again
            await until(lambda: routed(again.url, "m"), "m in the restarted gw-0's table")
            back_at = traffic.mark("gw-0 back")
            await until(
                lambda: (
                    sum(
                        o.url == again.url and o.kind == COMPLETE
                        for o in traffic.outcomes
                        if o.started >= back_at
                    )
                    >= 2
                ),
                "answers through the restarted gw-0",
            )
            graceful = [o for o in traffic.outcomes]
            killed_at = traffic.mark("gw-1 killed")
            b.proc.kill()
            b.proc.wait(timeout=deadline(30))
            planes.gateways.remove(b)
            traffic.mark("gw-1 dead")
            await traffic.wait_finished(8, since=time.monotonic())
        after = await scales_from_zero(planes, tiny_model_dir)
    # The graceful stop: nothing lost, in any phase up to the kill; some answers finished on gw-0
    # after its SIGTERM (they were in flight), and the others went to gw-1.
    row("gateway stopped", "SIGTERM to 1 of 2 gateways under load", graceful, began,
        notes=f"{traffic.unreached} connection(s) refused by the stopped gateway, sent to the other")  # fmt: skip
    assert not lost(graceful), (traffic.by_phase(), describe(graceful))
    assert any(o.url == a.url and o.ended > stopped_at for o in graceful if o.kind == COMPLETE)
    # The kill: what failed was on gw-1, in flight at the kill, cut on the wire; each retried on gw-0.
    at_kill = [o for o in traffic.outcomes if o.ended >= killed_at]
    cut = [o for o in at_kill if o.kind == LOST]
    row("gateway killed", "SIGKILL to 1 of 2 gateways under load", at_kill, killed_at, failed_at_fault=len(cut),
        notes="each request cut on the killed gateway retried on the other: all complete")  # fmt: skip
    assert all(o.url == b.url and o.transport_error and o.started < killed_at for o in cut), describe(cut)
    retries = {id(o.retry_of): o for o in at_kill if o.retry_of is not None}
    assert all(retries[id(o)].kind == COMPLETE and retries[id(o)].url == again.url for o in cut), describe(
        at_kill
    )
    assert not [o for o in at_kill if o.kind == LOST and o.url != b.url], describe(at_kill)
    assert after.kind == COMPLETE, after.reason


async def test_the_controller_killed_in_the_middle_of_a_canary(
    make_planes, tiny_model_dir: Path, tmp_path
) -> None:
    """SIGKILL to the controller while a 50 % canary's instance starts, under load through both
    gateways; a new controller on its data dir. The gateways route on meanwhile: none lost. The
    rollout resumes: the canary comes up and takes its share; every revision given traffic serves,
    and no engine runs that the controller does not own."""
    began = time.monotonic()
    planes = make_planes()
    c = planes.controller
    canary_model = build_tiny_model(tmp_path / "tiny-b", seed=1)
    async with asyncio.timeout(SCENARIO_S):
        await deploy(c.url, "m", tiny_model_dir, min_warm=1, max=1, idle_timeout_s=600)
        await until(lambda: ready(c.url, "m"), "m READY")
        for g in planes.urls:
            await until(lambda g=g: routed(g, "m"), f"m in {g}'s table")
        async with load(planes) as traffic:
            await traffic.wait_finished(8)
            await deploy(c.url, "m", canary_model, min_warm=1, max=1, idle_timeout_s=600, canary_percent=50)
            await until(
                lambda: c.engine_pids() and len(engines_of(c.home)) == 2, "the canary's engine spawned"
            )
            assert traffic_of(await get(c.url, "/admin/v1/deployments/m/revisions")) == {1: 100, 2: 0}
            killed_at = traffic.mark("controller killed")
            c.proc.kill()
            c.proc.wait(timeout=deadline(30))
            await traffic.wait_finished(6, since=killed_at)  # served by the gateways alone
            again = await asyncio.to_thread(planes.restart_controller)
            traffic.mark("controller back")
            await until(
                lambda: settled(again.url, {1: 50, 2: 50}), "the canary resumed: READY, with its share"
            )
            resumed_at = traffic.mark("canary serving")
            await until(
                lambda: (
                    {o.instance for o in traffic.outcomes if o.started >= resumed_at and o.kind == COMPLETE}
                    >= set(again.engine_pids())
                ),
                "answers from both revisions' instances",
            )
        after = await scales_from_zero(planes, tiny_model_dir)
    outcomes = traffic.outcomes
    row("controller killed mid-canary", "SIGKILL while a 50 % canary starts; restarted", outcomes, began,
        notes="the canary resumed after the restart; no engine left that the controller does not own")  # fmt: skip
    assert not lost(outcomes), (traffic.by_phase(), describe(outcomes))
    assert all(o.kind == COMPLETE for o in outcomes), (traffic.by_phase(), [o.reason for o in outcomes])
    assert engines_of(again.home) == set(again.engine_pids().values()) | set(), "an engine not owned"
    assert after.kind == COMPLETE, after.reason


def traffic_of(revisions: dict) -> dict[int, int]:
    return {r["revision"]: r["traffic_percent"] for r in revisions["data"]}


async def settled(url: str, want: dict[int, int]) -> bool:
    """The traffic is `want`, and every revision given traffic has a READY instance."""
    rows = (await get(url, "/admin/v1/deployments/m/revisions"))["data"]
    given = {r: p for r, p in traffic_of({"data": rows}).items() if p}
    if given == want and all(r["ready"] >= 1 for r in rows if r["traffic_percent"]):
        return True
    raise Unsettled(str([{k: r[k] for k in ("revision", "traffic_percent", "state", "ready")} for r in rows]))


class Unsettled(KeyError):
    """Not yet: the revisions as they are (the message of `until`'s timeout)."""


def engines_of(home: Path) -> set[int]:
    """The live engine processes started for this data dir, whoever started them: those whose
    command line names a snapshot under it (a fresh `stoker engine`), and those that carry its owner
    mark and listen on a TCP port (an engine a warm runtime became keeps the runtime's command
    line; a runtime still waiting listens on a unix socket only)."""
    mark = f"STOKER_ENGINE_OF={home.resolve()}".encode()
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(home) in cmdline and " engine" in cmdline:
                found.add(int(proc.name))
            elif " runtime " in cmdline and mark in (proc / "environ").read_bytes().split(b"\0"):
                listening = psutil.Process(int(proc.name)).net_connections(kind="tcp")
                if any(c.status == psutil.CONN_LISTEN for c in listening):
                    found.add(int(proc.name))
        except (OSError, psutil.Error):
            continue
    return {pid for pid in found if pid_alive(pid)}


async def test_the_controller_stopped_past_the_staleness_bound(make_planes, tiny_model_dir: Path) -> None:
    """SIGSTOP to the controller for longer than the gateways' staleness bound, under load: the
    gateways route on to the READY instance (every request complete). A request to a deployment at
    zero is held as long as the controller said its start takes (1.5 × `expected_start_s`, from
    the routing table, not the 1 s `--hold-deadline`) and then refused with Retry-After. On SIGCONT
    all recovers: that deployment scales from zero through a gateway."""
    began = time.monotonic()
    planes = make_planes("--hold-deadline", "1s")
    c, (a, b) = planes.controller, planes.gateways
    async with asyncio.timeout(SCENARIO_S):
        await deploy(c.url, "m", tiny_model_dir, min_warm=1, max=1, idle_timeout_s=600)
        await deploy(c.url, "z", tiny_model_dir, min_warm=0, max=1, idle_timeout_s=600)
        await until(lambda: ready(c.url, "m"), "m READY")
        for g in planes.urls:
            for name in ("m", "z"):
                await until(lambda g=g, name=name: routed(g, name), f"{name} in {g}'s table")
        expected = await until_value(lambda: expected_start(c, "z"), "z's expected start in the table")
        async with load(planes) as traffic:
            await traffic.wait_finished(8)
            stopped_at = traffic.mark("controller stopped")
            os.kill(c.proc.pid, signal.SIGSTOP)
            try:
                held = await one(b.url, "z")  # at zero, the controller away: held, then refused
                await traffic.wait_finished(8, since=stopped_at)
                assert time.monotonic() - stopped_at > 2 * STALE_S
            finally:
                os.kill(c.proc.pid, signal.SIGCONT)
            resumed_at = traffic.mark("controller resumed")
            await traffic.wait_finished(8, since=resumed_at)
        after = await retried(lambda: one(a.url, "z"))
    outcomes = [*traffic.outcomes, held, *after]
    row("controller stopped", f"SIGSTOP past the {STALE_S} s staleness bound, then SIGCONT", outcomes, began,
        notes=f"a request at zero held {held.seconds:.1f} s (1.5 x the expected {expected:.1f} s start), "
              "then refused with Retry-After")  # fmt: skip
    assert not lost(outcomes), (traffic.by_phase(), describe(outcomes))
    assert all(o.kind == COMPLETE for o in traffic.outcomes), traffic.by_phase()
    assert held.kind == REFUSED and held.reason == "503 hold_deadline", held.reason
    assert held.seconds >= 1.5 * expected * 0.95, (held.seconds, expected)  # not the 1 s flag
    assert after[-1].kind == COMPLETE, [o.reason for o in after]


async def expected_start(c: PlatformProcess, name: str) -> float | None:
    table = await get(c.url, "/cluster/v1/routes?gateway=gw-0")
    return table["deployments"][name]["units"]["1"].get("expected_start_s")


async def until_value(read: Callable[[], object], what: str) -> float:
    box: list = []

    async def got() -> bool:
        box[:] = [await read()]
        return box[0] is not None

    await until(got, what)
    return box[0]


async def retried(ask: Callable[[], object], tries: int = 5) -> list[Outcome]:
    """A client that honours Retry-After: asks again after each clean refusal, up to `tries`."""
    outcomes = []
    for _ in range(tries):
        outcomes.append(await ask())
        if outcomes[-1].kind != REFUSED:
            break
        await asyncio.sleep(1)
    return outcomes


@pytest.fixture
def relay():
    r = CutRelay()
    yield r
    r.close()


async def test_the_network_between_gateways_and_controller_cut_then_healed(
    make_planes, relay: CutRelay, tiny_model_dir: Path
) -> None:
    """The gateways reach the controller through a relay the test black-holes for longer than the
    staleness bound and the deployment's idle timeout, under load: warm traffic all complete (the
    gateways route by their last table, and the controller takes their silence for the load they
    had, not for idleness: before, it scaled the instance under them to zero, and their requests
    hung). A deployment made on the controller during the cut reaches the gateways once it heals,
    and scales from zero through them."""
    began = time.monotonic()
    planes = make_planes(controller_url=relay.start)
    c, (a, b) = planes.controller, planes.gateways
    idle_s = 4  # m's idle timeout: the cut lasts longer
    async with asyncio.timeout(SCENARIO_S):
        await deploy(c.url, "m", tiny_model_dir, min_warm=0, max=1, idle_timeout_s=idle_s)
        for g in planes.urls:
            await until(lambda g=g: routed(g, "m"), f"m in {g}'s table")
        async with load(planes) as traffic:
            await traffic.wait_finished(8)  # m came up from zero for them
            cut_at = traffic.mark("cut")
            relay.cut()
            await deploy(c.url, "late", tiny_model_dir, min_warm=0, max=1, idle_timeout_s=600)
            await traffic.wait_finished(8, since=cut_at)
            await until(lambda: time.monotonic() - cut_at > idle_s + 3 * STALE_S, "past the idle timeout")
            assert not await routed(a.url, "late")  # the cut holds: nothing new reached them
            healed_at = traffic.mark("healed")
            relay.heal()
            for g in planes.urls:
                await until(lambda g=g: routed(g, "late"), f"the late deployment in {g}'s table")
            await traffic.wait_finished(8, since=healed_at)
        after = await one(b.url, "late")
    outcomes = [*traffic.outcomes, after]
    row("network cut", "gateways cut off the controller past the staleness bound and the idle timeout, then healed",
        outcomes, began, notes="a deployment made during the cut reached the gateways after it and scaled from zero")  # fmt: skip
    assert not lost(outcomes), (traffic.by_phase(), describe(outcomes))
    assert all(o.kind == COMPLETE for o in outcomes), (traffic.by_phase(), [o.reason for o in outcomes])


async def test_engines_killed_and_stopped_during_a_revision_switch(
    make_planes, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A new revision warms two instances to take over from the two of the old one; meanwhile one
    old engine is SIGKILLed and the other SIGSTOPped, under load. None lost (a stream mid-answer on
    the killed one may end with an error event: refused); the switch completes, every request
    after it answered by the new revision, and no engine of the old one is left running."""
    began = time.monotonic()
    planes = make_planes(*SICK_FLAGS)
    c = planes.controller
    new_model = build_tiny_model(tmp_path / "tiny-b", seed=1)
    flags = {"min_warm": 2, "max": 2, "idle_timeout_s": 600, "grace_period_s": 5}
    async with asyncio.timeout(SCENARIO_S):
        await deploy(c.url, "m", tiny_model_dir, **flags)
        await until(lambda: ready(c.url, "m", 2), "two READY instances of revision 1")
        for g in planes.urls:
            await until(lambda g=g: routed(g, "m"), f"m in {g}'s table")
        old = dict(c.engine_pids())
        killed, stopped = (old[i] for i in sorted(old))
        async with load(planes) as traffic:
            await traffic.wait_finished(8)
            await deploy(c.url, "m", new_model, **flags)  # revision 2 warms, then takes over
            await until(lambda: len(engines_of(c.home)) > 2, "revision 2's engines spawned")
            faulted_at = traffic.mark("faults")
            os.kill(killed, signal.SIGKILL)
            os.kill(stopped, signal.SIGSTOP)
            try:
                await until(lambda: settled(c.url, {2: 100}), "revision 2 serving all", deadline(180))
                await until(lambda: not pid_alive(killed) and not pid_alive(stopped), "the old engines gone")
            finally:
                if pid_alive(stopped):
                    os.kill(stopped, signal.SIGCONT)
            new = set(c.engine_pids()) - set(old)
            switched_at = traffic.mark("switched")
            await until(
                lambda: {o.instance for o in traffic.outcomes if o.started >= switched_at} >= new,
                "answers from both new instances",
            )
        after = await scales_from_zero(planes, tiny_model_dir)
    outcomes = traffic.outcomes
    row("engines during a switch", "1 old engine SIGKILLed, 1 SIGSTOPped while revision 2 warms", outcomes,
        began, notes="the switch completed; no old engine left")  # fmt: skip
    assert not lost(outcomes), (traffic.by_phase(), describe(outcomes))
    assert all(o.kind == COMPLETE for o in outcomes if o.ended < faulted_at), traffic.by_phase()
    # Only a stream mid-answer on the killed or stopped engine ends with an error event (its tokens
    # so far reached the client, so it cannot be retried); everything else was retried or held.
    assert all(o.stream and o.started < faulted_at for o in outcomes if o.kind == REFUSED), [
        (o.reason, o.phase) for o in outcomes if o.kind != COMPLETE
    ]
    assert all(o.kind == COMPLETE and o.instance in new for o in traffic.phase("switched")), (
        traffic.by_phase()
    )
    assert engines_of(c.home) == set(c.engine_pids().values()) and not set(old) & set(c.engine_pids())
    assert after.kind == COMPLETE, after.reason
