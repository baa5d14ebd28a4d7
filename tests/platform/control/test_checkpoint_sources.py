"""What each source of checkpoints writes and takes back (`stoker.control.checkpoint`): the cost
meter's ledgers onto a clock whose origin moved, buckets past the 24 h window dropped; the history's
points within its hour; the pools' policy states by name@revision. Logical clocks, real objects."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore
from stoker.control.history import HistoryConfig, HistorySampler, restored_points
from stoker.control.history import point as history_point
from stoker.control.policy_states import PolicyStates
from tests.platform.control.test_checkpoint import Clock, meter
from warm_pool.backends.memory import MemoryBackend
from warm_pool.metrics import PoolMetrics
from warm_pool.policies import make_policy
from warm_pool.policies.base import ScalingConfig
from warm_pool.policies.rules import RuledState
from warm_pool.pool import Pool, PoolSpec
from warm_pool.snapshot import SnapshotSource

WALL = 1_764_568_800.0


def json_round(body: dict) -> dict:
    return json.loads(json.dumps(body, allow_nan=False))


# ---- cost ---------------------------------------------------------------------------------------------


def test_cost_comes_back_onto_a_clock_whose_origin_moved():
    # Run 1: the clock reads 10_000 at wall WALL; 3 minutes of READY and requests, then a restart.
    clock, wall = Clock(10_000.0), Clock(WALL)
    a = meter(clock, wall)
    for minute in range(3):
        clock.now, wall.now = 10_000.0 + minute * 60, WALL + minute * 60
        a.instance_seconds("chat", 1, "cpu", "READY", 60.0)
        a.record("chat", 1, wall.now, 10, 20, 200)
    body = json_round(a.checkpoint())
    before = {since: a.report(since) for since in (None, 90.0, 3600.0)}
    # Run 2, 30 s later by the wall, after a reboot: its clock reads 5 (the origin moved 10_125 s on).
    clock2, wall2 = Clock(5.0), Clock(wall.now + 30)
    b = meter(clock2, wall2)
    b.restore(body)
    clock.now += 30
    assert b.report() == before[None] == a.report()
    assert b.report(3600.0) == a.report(3600.0)
    assert b.report(90.0) == a.report(90.0)  # the last minutes, minute by minute, where they were
    [row] = b.report(90.0)
    assert row["requests"] == 2 and row["instance_seconds"] == {"READY": 120.0}


def test_buckets_older_than_the_window_are_dropped_and_the_totals_kept():
    clock, wall = Clock(0.0), Clock(WALL)
    a = meter(clock, wall)
    a.record("chat", 1, WALL, 1, 1, 200)
    clock.now, wall.now = 3600.0, WALL + 3600
    a.record("chat", 1, wall.now, 1, 1, 200)
    body = json_round(a.checkpoint())
    # Back 24 h after the first request and 30 minutes: the first bucket is past the window.
    b = meter(Clock(0.0), Clock(WALL + 86_400 + 1800))
    b.restore(body)
    [total] = b.report()
    [day] = b.report(86_400.0)
    assert (total["requests"], day["requests"]) == (2, 1)
    assert len(b._revisions[("chat", 1)].minutes) == 1


def test_after_a_restore_the_deployment_counts_on():
    clock, wall = Clock(0.0), Clock(WALL)
    a = meter(clock, wall)
    a.record("chat", 1, WALL, 3, 4, 200)
    b = meter(Clock(50.0), Clock(WALL + 50))
    b.restore(json_round(a.checkpoint()))
    assert b.tap(lambda m: None, "chat", 1) is None  # restored ledgers, but no pool here yet
    spec = SimpleNamespace(
        name="chat", revision=1, snapshot_id="s", engine="cpu", engine_settings=SimpleNamespace(gpus=None)
    )
    b.pool_metrics(PoolMetrics(CollectorRegistry()), spec)  # its pool is made again
    tap = b.tap(lambda m: None, "chat", 1)
    assert tap is not None
    b.done(tap, {"stoker.revision": 1})
    [row] = b.report()
    assert row["requests"] == 2 and row["tokens_in"] == 3


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda b: b.update(extra=[]), "cost: want the fields revisions, deployments"),
        (
            lambda b: b["revisions"][0].update(revision=0),
            "cost.revisions[0].revision: want a whole number ≥ 1",
        ),
        (lambda b: b["revisions"][0].update(deployment="../x"), "cost.revisions[0].deployment: bad name"),
        (lambda b: b["revisions"].append(b["revisions"][0]), "cost.revisions[1]: chat revision 1 twice"),
        (lambda b: b["revisions"][0]["ledger"]["total"].update(evil=1), "bad name 'evil'"),
        (lambda b: b["revisions"][0]["ledger"]["minutes"].reverse(), "the minutes must rise"),
        (lambda b: b["revisions"][0]["ledger"]["minutes"][0].append(1), "3 items, more than 2"),
        (lambda b: b["deployments"].clear(), "no ledger of chat"),
        (
            lambda b: b["revisions"][0]["ledger"].update(minutes=[[0, {}]] * 1442),
            "1442 items, more than 1441",
        ),
    ],
)
def test_a_bad_cost_body_is_refused_and_nothing_is_taken(change, fragment):
    clock, wall = Clock(0.0), Clock(WALL)
    a = meter(clock, wall)
    a.record("chat", 1, WALL, 1, 1, 200)
    clock.now = 120.0  # a second minute
    wall.now = WALL + 120
    a.record("chat", 1, wall.now, 1, 1, 200)
    body = json_round(a.checkpoint())
    change(body)
    b = meter(Clock(0.0), Clock(WALL))
    with pytest.raises(ValueError) as err:
        b.restore(body)
    assert fragment in str(err.value)
    assert b.report() == []


# ---- history ------------------------------------------------------------------------------------------


def point(t: float, requests: float = 1.0) -> dict:
    figures = {
        "requests_per_s": requests,
        "arrivals_per_s": requests,
        "errors_per_s": 0.0,
        "forecast_per_s": None,
        "queued": 0,
        "instances": {"READY": 1},
        "cold_starts": {"disk": 1},
        "start_s": {"disk": 7.7},
        "hold_s": None,
        "instance_seconds": {"READY": 5.0},
        "cost_usd": 0.001,
    }
    return {"t": t, "dt": 5.0, "deployments": {"chat": figures}}


def sampler(wall: Clock, interval_s: float = 5.0) -> HistorySampler:
    return HistorySampler(CollectorRegistry(), HistoryConfig(interval_s=interval_s), clock=Clock(), wall=wall)


def test_the_history_comes_back_within_its_hour_before_the_new_points():
    wall = Clock(WALL)
    a = sampler(wall)
    a.history.restore([point(WALL - 4000), point(WALL - 100), point(WALL - 5)])
    body = json_round(a.checkpoint())
    b = sampler(Clock(WALL + 60))
    b.restore(body)
    assert [p["t"] for p in b.history.snapshot()["points"]] == [WALL - 100, WALL - 5]  # the hour's
    assert b.history.snapshot()["points"][0] == point(WALL - 100)
    # A shorter interval now (fewer points fit): the newest are kept.
    c = sampler(Clock(WALL + 60), interval_s=300.0)
    c.restore(body)
    assert len(c.history.snapshot()["points"]) == 2  # 3600 / 300 = 12 fit


def test_a_point_as_the_history_makes_it_is_one_the_checkpoint_reads():
    # A figure added to `point` needs its check in `stoker.control.history._figures` too.
    chat = (("deployment", "chat"),)
    reading = {
        ("stoker_requests_total", (("code", "200"), *chat)): 10.0,
        ("stoker_instances", (*chat, ("state", "READY"))): 1.0,
        ("stoker_cold_start_requests_total", (*chat, ("tier", "disk"))): 1.0,
        ("stoker_instance_startup_seconds_sum", (*chat, ("tier", "disk"))): 7.7,
        ("stoker_instance_startup_seconds_count", (*chat, ("tier", "disk"))): 1.0,
        ("stoker_scaler_forecast_requests_per_second", chat): 0.5,
        ("stoker_cost_usd_total", (*chat, ("state", "READY"))): 0.01,
    }
    made = {"t": WALL, "dt": 5.0, "deployments": history_point({}, reading, 5.0)}
    assert set(made["deployments"]["chat"]) == set(point(WALL)["deployments"]["chat"])
    assert restored_points(json_round({"points": [made]}), HistoryConfig(), WALL + 1) == [json_round(made)]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda p: p.update(t="now"), "history.points[1].t: want a finite number"),
        (lambda p: p.update(t=0.0), "history.points[1].t: the points' times must rise"),
        (lambda p: p["deployments"]["chat"].pop("queued"), "missing ['queued']"),
        (lambda p: p["deployments"]["chat"].update(queued=-1), "queued: want a whole number ≥ 0"),
        (lambda p: p["deployments"]["chat"]["instances"].update({"<script>": 1}), "bad name '<script>'"),
        (lambda p: p["deployments"]["chat"].update(cost_usd=[1]), "cost_usd: want a finite number"),
    ],
)
def test_a_bad_point_refuses_the_whole_history(change, fragment):
    wall = Clock(WALL)
    a = sampler(wall)
    a.history.restore([point(WALL - 20), point(WALL - 10)])
    body = json_round(a.checkpoint())
    change(body["points"][1])
    b = sampler(wall)
    with pytest.raises(ValueError) as err:
        b.restore(body)
    assert fragment in str(err.value)
    assert b.history.snapshot()["points"] == []


# ---- the pools' policy states ------------------------------------------------------------------------


def pool(tmp_path, policy: str, revision: int = 1) -> Pool:
    source = SnapshotSource(SnapshotStore(tmp_path / "store"), "0" * 64)
    spec = PoolSpec("chat", source, scaling=ScalingConfig(max=2), policy=policy, revision=revision)
    return Pool(spec, MemoryBackend(), PoolMetrics(CollectorRegistry()), clock=lambda: 0.0)


def learned(policy: str) -> RuledState:
    """A state with something learned: a few calls of the real policy."""
    from tests.warm_pool.policy_script import obs, second

    bound = make_policy(policy, ScalingConfig(max=2))
    state = bound.initial_state
    for t in range(1, 40):
        o = obs(seconds=(second(t - 1, 1.0, arrivals=1),), in_flight=1, ready=1, last_arrival=t - 0.5)
        _, state = bound.decide(o, state, float(t))
    _, state = bound.decide(obs(idle_gaps=(30.0,), ready=1, idle_since=40.0, last_arrival=39.5), state, 41.0)
    return state


def test_each_pool_takes_back_its_own_policy_state_once(tmp_path, caplog):
    caplog.set_level("INFO", logger="stoker.platform")
    running = [("chat@2", pool(tmp_path, "predictive", 1)), ("other@1", pool(tmp_path, "kpa"))]
    state = learned("predictive")
    running[0][1].restore_policy("predictive", state)
    running[1][1].restore_policy("kpa", learned("kpa"))
    clock, wall = Clock(500.0), Clock(WALL)
    body = json_round(PolicyStates(lambda: running, clock, wall).checkpoint())
    assert [(p["pool"], p["policy"]) for p in body["pools"]] == [("chat@2", "predictive"), ("other@1", "kpa")]

    # Restored on a clock that moved by 200 s: the new pool of chat@2 carries on; other@1 was
    # redeployed with another policy and starts afresh; a pool of another revision gets nothing.
    states = PolicyStates(lambda: [], Clock(300.0), wall)
    states.restore(body)
    chat, other, newer = (
        pool(tmp_path, "predictive", 2),
        pool(tmp_path, "predictive"),
        pool(tmp_path, "predictive", 3),
    )
    states.take("chat@2", chat)
    states.take("other@1", other)
    states.take("chat@3", newer)
    initial = make_policy("predictive", ScalingConfig(max=2)).initial_state
    restored = chat.saved_policy()[1]
    assert restored.inner.histogram == state.inner.histogram
    assert restored.inner.forecast.holt == state.inner.forecast.holt
    assert restored.last_up == pytest.approx(state.last_up - 200.0)
    assert other.saved_policy()[1] == initial and newer.saved_policy()[1] == initial
    again = pool(tmp_path, "predictive", 2)
    states.take("chat@2", again)  # once only
    assert again.saved_policy()[1] == initial
    messages = [r.getMessage() for r in caplog.records]
    assert "pool chat@2: carries on with its predictive policy's learned state" in messages
    assert "pool other@1: starts its predictive policy afresh (the checkpoint holds kpa's state)" in messages


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda e: e.update(pool="chat"), "policies.pools[0].pool: want name@revision, got 'chat'"),
        (lambda e: e.update(pool="Chat@1"), "want name@revision"),
        (
            lambda e: e.update(policy="oracle"),
            "policies.pools[0].policy: 'oracle' is not one this version has",
        ),
        (
            lambda e: e["state"]["rules"].update(last_ready="2"),
            "policies.pools[0] (chat@1): policy predictive state",
        ),
    ],
)
def test_a_bad_policy_entry_refuses_them_all(tmp_path, change, fragment):
    running = [("chat@1", pool(tmp_path, "predictive")), ("chat@2", pool(tmp_path, "predictive", 2))]
    body = json_round(PolicyStates(lambda: running, Clock(), Clock(WALL)).checkpoint())
    change(body["pools"][0])
    states = PolicyStates(lambda: [], Clock(), Clock(WALL))
    with pytest.raises(ValueError) as err:
        states.restore(body)
    assert fragment in str(err.value)
    fresh = pool(tmp_path, "predictive", 2)
    states.take("chat@2", fresh)  # the good entry was not taken either
    assert fresh.saved_policy()[1] == make_policy("predictive", ScalingConfig(max=2)).initial_state
