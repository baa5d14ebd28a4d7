"""Revisions with real engines: an update to another model under steady load (warm before the
switch, no error), a settings-only update in place, a canary by user, a rollback, and a canary that
rolls itself back. One `stoker up`, one tiny model per side (two seeds: two snapshots)."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import build_tiny_model
from tests.deadlines import ENGINE_START, deadline

WITHIN_S = ENGINE_START  # bound on event-driven waits (engine starts), never a measurement


@pytest.fixture(scope="module")
def model_b(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-b") / "tiny-llama-b", seed=1)


class Load:
    """Requests in a loop from two threads until stopped: every status and revision seen, in order."""

    def __init__(self, url: str, users: int = 1) -> None:
        self.url, self.users = url, users
        self.seen: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(2)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=WITHIN_S)

    def _run(self, n: int) -> None:
        with httpx.Client(timeout=WITHIN_S) as client:
            for i in itertools.count():
                if self._stop.is_set():
                    return
                r = ask(client, self.url, user=f"load-{n}-{i % self.users}")
                self.seen.append((r.status_code, r.headers.get("x-stoker-revision")))


def ask(client: httpx.Client, url: str, user: str | None = None) -> httpx.Response:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if user is not None:
        body["user"] = user
    return client.post(f"{url}/v1/chat/completions", json=body)


def revisions(p) -> dict[int, dict]:
    """`stoker revisions chat --json` by revision, read over HTTP (polled; the CLI is used below)."""
    return {r["revision"]: r for r in p.admin_get("/admin/v1/deployments/chat/revisions")["data"]}


def test_updates_canaries_and_rollbacks_move_traffic_without_an_error(
    platform_factory, tiny_model_dir, model_b
) -> None:
    p = platform_factory("--stable-window", "2")
    p.deploy("chat", tiny_model_dir, "--min-warm", "1", "--max", "2", "--idle-timeout", "600")
    p.wait_for(lambda: revisions(p)[1]["ready"] == 1, WITHIN_S, "revision 1 READY")

    # 1. Another model under steady load: revision 2 warms, takes the traffic, revision 1 retires.
    with Load(p.url) as load:
        p.wait_for(lambda: len(load.seen) >= 3, WITHIN_S, "load flowing")
        out = p.deploy("chat", model_b, "--min-warm", "1", "--max", "2", "--idle-timeout", "600")
        assert out["deployed"]["revision"] == 2 and out["deployed"]["state"] in ("warming", "serving")
        p.wait_for(
            lambda: (r := revisions(p))[2]["traffic_percent"] == 100 and r[1]["state"] == "retired",
            WITHIN_S,
            "revision 2 serving, revision 1 gone",
        )
        seen_at_switch = len(load.seen)
        p.wait_for(lambda: len(load.seen) >= seen_at_switch + 4, WITHIN_S, "load after the switch")
    assert {code for code, _ in load.seen} == {200}, load.seen
    assert load.seen[0][1] == "1" and {rev for _, rev in load.seen[-2:]} == {"2"}
    assert p.metric("stoker_revision_requests_total", deployment="chat", revision="2", code="200") > 0

    # 2. Settings only: revision 3 takes over in place, on the same engine.
    before = {i["id"] for i in p.deployments()["chat"]["instance_list"]}
    out = p.deploy(
        "chat", model_b, "--min-warm", "1", "--max", "3", "--idle-timeout", "600", "--balance", "prefix"
    )
    assert out["deployed"]["state"] == "serving" and out["max"] == 3 and out["revision"] == 3
    assert out["balance"] == "prefix"
    assert {i["id"] for i in out["instance_list"]} == before
    with httpx.Client(timeout=WITHIN_S) as client:
        assert ask(client, p.url).headers["x-stoker-revision"] == "3"

    # 3. A canary split by user: one user sees one revision; both sides answer.
    split = json.loads(p.cli("traffic", "chat", "1=50", "3=50", "--json").stdout)
    assert {r["revision"]: r["traffic_percent"] for r in split} == {1: 50, 2: 0, 3: 50}
    with httpx.Client(timeout=WITHIN_S) as client:
        first = {u: ask(client, p.url, user=f"u{u}").headers["x-stoker-revision"] for u in range(12)}
        again = {u: ask(client, p.url, user=f"u{u}").headers["x-stoker-revision"] for u in range(12)}
    assert first == again and set(first.values()) == {"1", "3"}

    # 4. Rollback from a split: to the side with the most traffic besides the newest revision (3).
    p.cli("rollback", "chat")
    p.wait_for(lambda: revisions(p)[3]["state"] == "retired", WITHIN_S, "revision 3 gone")
    assert revisions(p)[1]["traffic_percent"] == 100
    # ... and to an exact earlier revision: 2's snapshot and settings, warm before the switch.
    out = json.loads(p.cli("rollback", "chat", "--to", "2", "--json").stdout)
    p.wait_for(lambda: revisions(p)[2]["traffic_percent"] == 100, WITHIN_S, "revision 2 serving again")
    d = p.deployments()["chat"]
    r = revisions(p)
    assert (d["revision"], d["snapshot_id"], d["max"]) == (2, r[2]["snapshot_id"], 2)
    assert r[2]["snapshot_id"] != r[1]["snapshot_id"]

    # 5. A canary that asks for it rolls itself back: every first byte misses its 1 µs objective.
    status = httpx.post(
        f"{p.url}/admin/v1/deployments",
        json={
            "name": "chat",
            "model": str(model_b),
            "max": 2,
            "canary_percent": 50,
            "auto_rollback": True,
            "rollback_ttft_s": 1e-6,
            "rollback_min_requests": 3,
            "idle_timeout_s": 600,
        },
        timeout=WITHIN_S,
    ).json()
    canary = status["deployed"]["revision"]
    p.wait_for(lambda: revisions(p)[canary]["traffic_percent"] == 50, WITHIN_S, "the canary warm")
    with Load(p.url, users=16) as load:
        p.wait_for(
            lambda: revisions(p)[canary]["state"].startswith("rolled back"),
            WITHIN_S,
            "the canary rolled back",
        )
    assert {code for code, _ in load.seen} == {200}
    r = revisions(p)
    assert r[2]["traffic_percent"] == 100 and "first byte later than" in r[canary]["state"]
    assert p.metric("stoker_revision_rollbacks_total", deployment="chat") == 1

    # 6. A restart brings back what served, and the whole history.
    assert json.loads(p.cli("revisions", "chat", "--json").stdout) == list(revisions(p).values())
    history = {rev: (row["snapshot_id"], row["traffic_percent"]) for rev, row in revisions(p).items()}
    assert p.stop() == 0
    again = platform_factory("--stable-window", "2", home=p.home)
    assert {
        rev: (row["snapshot_id"], row["traffic_percent"]) for rev, row in revisions(again).items()
    } == history
    with httpx.Client(timeout=WITHIN_S) as client:
        assert ask(client, again.url).headers["x-stoker-revision"] == "2"


def test_revision_requests_are_validated(shared_platform) -> None:
    p = shared_platform
    base = f"{p.url}/admin/v1/deployments"
    cases = [
        ("PUT", f"{base}/tiny/traffic", {"traffic": {"1": 50}}, 400, "traffic"),
        ("PUT", f"{base}/tiny/traffic", {"traffic": {"7": 100}}, 400, "traffic"),
        ("PUT", f"{base}/tiny/traffic", {"split": {}}, 400, "split"),
        ("PUT", f"{base}/nope/traffic", {"traffic": {"1": 100}}, 404, "name"),
        ("POST", f"{base}/tiny/rollback", {"to": 9}, 400, "to"),
        ("POST", f"{base}/tiny/rollback", {}, 409, "to"),  # nothing before revision 1
        ("POST", base, {"name": "tiny", "model": "x", "canary_percent": 0}, 400, "canary_percent"),
        ("POST", base, {"name": "fresh", "model": "x", "canary_percent": 10}, 400, "canary_percent"),
        ("GET", f"{base}/nope/revisions", None, 404, "name"),
    ]
    for method, url, body, status, param in cases:
        r = httpx.request(method, url, json=body, timeout=deadline(30))
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (method, url, body, r.text)
    bad = p.cli("traffic", "tiny", "1=fifty", check=False)
    assert bad.returncode == 1 and bad.stderr.startswith(
        "stoker: error: argument REV=PERCENT: a revision = a whole percent"
    )
    assert len(bad.stderr.splitlines()) == 1
