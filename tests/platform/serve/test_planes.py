"""The two planes as separate processes: `stoker controller` and two `stoker gateway`s on loopback,
the real CPU engine behind them. Requests held at zero through either gateway bring one instance
up; each gateway routes at most its share of it; the admin API goes through a gateway; a gateway
killed loses only its own requests; the controller killed loses none, and the one restarted on
the same data dir adopts the running engine (same process, no start)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import pytest

from stoker.spec.keys import hash_key
from tests.conftest import build_tiny_model
from tests.deadlines import COLD_ANSWER, deadline, flag
from tests.platform.conftest import PlatformProcess, pid_alive
from tests.platform.engine.conftest import free_port

ADMIN = "admin-key-for-planes"
ENV = {"STOKER_ADMIN_KEY": ADMIN}
H = {"authorization": f"Bearer {ADMIN}"}


def chat(
    url: str,
    content: str = "hi",
    *,
    model: str = "m",
    max_tokens: int = 4,
    stream: bool = False,
    timeout: float = COLD_ANSWER,
):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return httpx.post(
        f"{url}/v1/chat/completions", json={**body, "stream": stream}, headers=H, timeout=timeout
    )


def routes(controller: PlatformProcess, gateway: str) -> dict:
    r = httpx.get(
        f"{controller.url}/cluster/v1/routes", params={"gateway": gateway}, headers=H, timeout=deadline(30)
    )
    assert r.status_code == 200, r.text
    return r.json()


def starts(controller: PlatformProcess) -> float:
    return controller.metric("stoker_instance_starts_total", deployment="m", outcome="ready")


@pytest.fixture
def planes(tmp_path: Path):
    home = tmp_path / "home"
    controller = PlatformProcess(
        home,
        free_port(),
        # Its engines outlive a SIGKILL (adopted by the next one), not the test's final SIGTERM.
        (
            "--stable-window",
            "1",
            "--gateway-stale-after",
            "3",
            "--gateway-silent-grace",
            "5s",
            "--stop-instances-on-exit",
        ),
        extra_env=ENV,
        command="controller",
    ).start()
    gw_args = ("--controller", controller.url, "--report-interval", "0.2s", "--hold-deadline", flag(120))
    gateways = [
        PlatformProcess(
            tmp_path / f"gw{i}",
            free_port(),
            (*gw_args, "--gateway-id", f"gw-{i}"),
            extra_env=ENV,
            command="gateway",
        ).start()
        for i in range(2)
    ]
    started = [controller, *gateways]
    yield controller, gateways, started
    for p in started:
        p.stop()


def test_two_gateways_share_one_instance_and_survive_the_controller(planes, tiny_model_dir: Path) -> None:
    controller, (a, b), started = planes
    # The admin API through a gateway: the CLI may name either plane.
    deployed = a.deploy("m", tiny_model_dir, "--min-warm", "0", "--max", "1", "--idle-timeout", "600")
    assert deployed["name"] == "m"
    # The caller's key.
    assert httpx.get(f"{b.url}/admin/v1/deployments/m", timeout=deadline(10)).status_code == 401
    a.wait_for(lambda: any(c["id"] == "m" for c in httpx.get(f"{a.url}/v1/models", headers=H).json()["data"]))

    # Held at zero on both gateways at once: one instance comes up and serves both.
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda g=g: answers.append(chat(g.url))) for g in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert len({r.headers["x-stoker-instance"] for r in answers}) == 1
    assert starts(controller) == 1

    # Each live gateway routes at most its share of the instance (8 slots, two gateways).
    [endpoint] = routes(controller, "gw-0")["deployments"]["m"]["units"]["1"]["endpoints"]
    assert endpoint["max_concurrency"] == 4
    assert routes(controller, "gw-1")["gateways"] == 2
    # Stoker's engine takes a body's priority: the gateway passes it on, after checking it.
    assert routes(controller, "gw-0")["deployments"]["m"]["units"]["1"]["engine_priority"] is True
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for priority, status in ((-7, 200), (5000, 400)):
        r = httpx.post(
            f"{a.url}/v1/chat/completions",
            json={**body, "priority": priority},
            headers=H,
            timeout=COLD_ANSWER,
        )
        assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "priority"

    # Kept warm from here, so that what follows sees one READY instance throughout.
    a.deploy("m", tiny_model_dir, "--min-warm", "1", "--max", "1", "--idle-timeout", "600")
    a.deploy("z", tiny_model_dir, "--min-warm", "0", "--max", "1")  # and one at zero
    # The controller dies: the gateways route on to the READY instance.
    engine = next(iter(controller.engine_pids().values()))
    controller.stop(signal.SIGKILL)
    for g in (a, b):
        r = chat(g.url)
        assert r.status_code == 200, r.text
    assert httpx.get(f"{a.url}/healthz").json()["controller"] == "unreachable"
    assert chat(a.url).headers["x-stoker-instance"] == answers[0].headers["x-stoker-instance"]
    assert pid_alive(engine)
    # A request to the deployment at zero is held while the controller is away...
    held: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: held.append(chat(b.url, model="z")))
    waiter.start()

    # Restarted on the same data dir and port: the running engine is adopted, not restarted.
    again = PlatformProcess(
        controller.home, controller.port, controller.args, extra_env=ENV, command="controller"
    )
    again.start()
    started.append(again)
    again.wait_for(lambda: again.deployments()["m"]["instances"]["READY"] == 1, what="adoption")
    [instance] = again.deployments()["m"]["instance_list"]
    assert instance["id"] == answers[0].headers["x-stoker-instance"]
    assert instance["runs_as"] == f"pid {engine}"
    assert starts(again) == 0  # no cold start
    again.wait_for(
        lambda: again.deployments()["m"]["decision"] is not None, what="the adopting pool deciding"
    )
    a.wait_for(lambda: httpx.get(f"{a.url}/healthz").json()["controller"] == "reachable", what="reconnect")
    assert chat(b.url).status_code == 200
    # ... and served once it is back: the gateway's report of it reaches the new controller.
    waiter.join()
    assert held[0].status_code == 200, held[0].text
    assert instance["id"] in again.engine_pids() and again.engine_pids()[instance["id"]] == engine


def test_a_gateway_killed_loses_only_its_own_requests(planes, tiny_model_dir: Path) -> None:
    controller, (a, b), _ = planes
    a.deploy("m", tiny_model_dir, "--min-warm", "1", "--max", "1", "--idle-timeout", "600")
    a.wait_for(lambda: chat(a.url).status_code == 200, timeout=deadline(120), what="a first answer")
    b.wait_for(lambda: chat(b.url).status_code == 200, timeout=deadline(60), what="an answer on b")

    outcome: dict[str, object] = {}

    def long_on(gateway: PlatformProcess, name: str) -> None:
        try:
            outcome[name] = chat(gateway.url, "tell me a long story", max_tokens=64, stream=True).status_code
        except httpx.TransportError as exc:
            outcome[name] = type(exc).__name__

    threads = [threading.Thread(target=long_on, args=(g, n)) for g, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    a.stop(signal.SIGKILL)
    for t in threads:
        t.join()
    assert outcome["b"] == 200  # the other gateway's request is untouched
    # The controller forgets the dead gateway: b gets the whole instance.
    controller.wait_for(
        lambda: (
            routes(controller, "gw-1")["deployments"]["m"]["units"]["1"]["endpoints"][0]["max_concurrency"]
            == 8
        ),
        what="b's share growing to the whole instance",
    )
    assert chat(b.url).status_code == 200


def test_the_admins_pinned_revision_answers_through_a_gateway(planes, tiny_model_dir: Path, tmp_path) -> None:
    """`stoker eval --revision N` through a `stoker gateway`: the admin's `x-stoker-revision: N`
    picks that revision there too, whatever the split would pick (the one step both planes share,
    `stoker.gateway.revisions.pick_revision`), and one it cannot answer with is a 400 naming it."""
    controller, (a, _), _ = planes
    model_b = build_tiny_model(tmp_path / "tiny-b", seed=1)
    flags = ("--min-warm", "1", "--max", "1", "--idle-timeout", "600")
    a.deploy("m", tiny_model_dir, *flags)
    a.deploy("m", model_b, *flags, "--canary", "50")  # revision 2 takes half, once warm
    a.wait_for(
        lambda: (
            {r["revision"]: r["ready"] for r in a.admin_get("/admin/v1/deployments/m/revisions")["data"]}
            == {1: 1, 2: 1}
        ),
        timeout=240,
        what="both revisions READY",
    )
    units = lambda: routes(controller, "gw-0")["deployments"]["m"]["units"]  # noqa: E731
    a.wait_for(lambda: all(u["endpoints"] for u in units().values()), what="gw-0 routing to both revisions")
    for pinned in ("1", "2"):
        answered = [
            httpx.post(
                f"{a.url}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={**H, "x-stoker-revision": pinned},
                timeout=120,
            )
            for _ in range(8)  # the split alone would pick both sides: 1 in 128 to pass by chance
        ]
        assert [(r.status_code, r.headers.get("x-stoker-revision")) for r in answered] == [(200, pinned)] * 8
    missing = httpx.post(
        f"{a.url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={**H, "x-stoker-revision": "9"},
        timeout=120,
    )
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "x-stoker-revision"


@pytest.fixture(scope="module")
def lone_controller(tmp_path_factory):
    """A controller with no gateway: the routing table's long poll is called here directly."""
    home = tmp_path_factory.mktemp("lone") / "home"
    controller = PlatformProcess(
        home, free_port(), ("--stable-window", "1"), extra_env=ENV, command="controller"
    )
    yield controller.start()
    controller.stop()


@pytest.mark.parametrize("change", ["create", "revoke"])
def test_a_key_made_or_revoked_is_news_to_the_gateways_at_once(lone_controller, change: str) -> None:
    """A gateway waiting on the routing table hears of a key made or revoked when it happens, not
    at the end of its long poll (20 s): a revoked key must stop working at every gateway now."""
    controller = lone_controller
    made = httpx.post(
        f"{controller.url}/admin/v1/keys",
        json={"tenant": "acme", "deployments": ["m"]},
        headers=H,
        timeout=deadline(30),
    )
    assert made.status_code == 201, made.text
    table = routes(controller, "gw-0")
    hashes = {k["hash"] for k in table["keys"]}
    if change == "create":
        again = httpx.post(
            f"{controller.url}/admin/v1/keys",
            json={"tenant": "acme", "deployments": ["m"]},
            headers=H,
            timeout=deadline(30),
        )
        assert again.status_code == 201, again.text
    else:
        gone = httpx.delete(
            f"{controller.url}/admin/v1/keys/{made.json()['id']}", headers=H, timeout=deadline(30)
        )
        assert gone.status_code == 200, gone.text
    # The long poll from the version seen answers with the change, well before its 20 s are up.
    params = {"gateway": "gw-0", "epoch": table["epoch"], "after": table["version"]}
    r = httpx.get(f"{controller.url}/cluster/v1/routes", params=params, headers=H, timeout=10)
    assert r.status_code == 200, r.text
    now = {k["hash"] for k in r.json()["keys"]}
    assert (
        (len(now) == len(hashes) + 1 and hashes < now)
        if change == "create"
        else now == hashes - {hash_key(made.json()["key"])}
    )
