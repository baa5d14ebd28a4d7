"""The simulator: requests conserved, runs deterministic for a seed, and a tiny trace worked by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from warm_pool.policies import POLICIES, make_policy
from warm_pool.policies.base import ScalingConfig, Tier, TierTimes
from warm_pool.profiles import GPU, InstanceModel
from warm_pool.simulate import Prices, Simulation, simulate
from warm_pool.trace import TraceRequest, load_trace

TRACES = Path(__file__).resolve().parents[1] / "data"  # a copy of the shared trace: see its README
SMALL = InstanceModel(
    startup=TierTimes(wake=1.0, page_cache=5.0, disk=10.0, object_storage=20.0),
    prefill_tps=100.0,
    decode_tps=10.0,
    concurrency=1,
    jitter=0.0,
    max_queue=10,
    deadline_s=100.0,
)


def code_trace(thin: int):
    return load_trace(TRACES / "azure-llm-code-2023-first29min.csv", thin=thin)


def test_a_tiny_trace_gives_the_waits_and_seconds_worked_out_by_hand():
    # t=0: 100 prompt tokens + 10 generated = 1 s + 1 s; t=1: 10 generated = 1 s. One slot, max 1.
    trace = (TraceRequest(0.0, 100, 10), TraceRequest(1.0, 0, 10))
    scaling = ScalingConfig(max=1, target_concurrency=1)
    report = simulate(
        trace, make_policy("keepalive", scaling), scaling=scaling, model=SMALL, prices=Prices(3.6, 0.0)
    )
    # a disk start is asked for at t=0 and READY at 10; request 0 runs 10-12, request 1 runs 12-13
    assert (report.served, report.rejected, report.cold_starts) == (2, 0, 2)
    assert (report.p50_wait_s, report.p99_wait_s, report.p99_ttft_s) == (10.0, 11.0, 11.0)
    assert report.gpu_seconds == pytest.approx(3.0)  # READY from 10 to the end at 13
    assert report.starting_seconds == pytest.approx(10.0)
    assert report.cost_per_1k_requests == pytest.approx(13 * 0.001 / 2 * 1000)  # $3.6/h = $0.001/s
    assert report.duration_s == 13.0
    # The same run with instances on 4 GPUs each: the same seconds, four times the awake cost.
    wide = simulate(
        trace,
        make_policy("keepalive", scaling),
        scaling=scaling,
        model=SMALL,
        prices=Prices(3.6, 0.0, gpus=4),
    )
    assert wide.gpu_seconds == report.gpu_seconds
    assert wide.cost_per_1k_requests == pytest.approx(4 * report.cost_per_1k_requests)
    with pytest.raises(ValueError, match="at least 1 device"):
        Prices(gpus=0)


def test_a_full_queue_and_a_passed_deadline_reject():
    trace = tuple(TraceRequest(t, 0, 10) for t in (0.0, 0.1, 0.2))
    scaling = ScalingConfig(max=1, target_concurrency=1)
    model = replace(SMALL, max_queue=1, deadline_s=5.0)
    sim = Simulation(trace, make_policy("kpa", scaling), scaling=scaling, model=model)
    report = sim.run()
    # two find the queue full at once; the held one is dropped at its 5 s deadline (the start takes 10)
    assert (report.served, report.rejected) == (0, 3)
    assert sim.outcomes == ["rejected"] * 3
    assert report.duration_s == 5.0


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_request_is_served_or_rejected_exactly_once(name):
    trace = code_trace(thin=10)
    scaling = ScalingConfig(max=4, target_concurrency=16)
    sim = Simulation(trace, make_policy(name, scaling), scaling=scaling, model=replace(GPU, max_queue=20))
    report = sim.run()  # the simulator raises if a request is settled twice
    assert None not in sim.outcomes
    assert sim.outcomes.count("served") == report.served
    assert sim.outcomes.count("rejected") == report.rejected
    assert report.served + report.rejected == report.requests == len(trace)
    assert 0 <= report.cold_starts <= report.served


def test_a_run_is_deterministic_for_a_seed_and_the_seed_matters():
    trace = code_trace(thin=20)
    scaling = ScalingConfig(max=16, target_concurrency=16)

    def run(seed):
        return simulate(trace, make_policy("predictive", scaling), scaling=scaling, seed=seed)

    first, again, other = run(1), run(1), run(2)
    assert first == again  # the timeline included
    assert first.summary() != other.summary()


def test_the_pre_warm_lands_before_each_arrival_once_the_gaps_are_learned():
    trace = tuple(TraceRequest(100.0 * k, 100, 10) for k in range(30))  # one request every 100 s
    scaling = ScalingConfig(max=1, target_concurrency=1)

    def cold(n: int, name: str) -> int:
        return simulate(trace[:n], make_policy(name, scaling), scaling=scaling, model=SMALL).cold_starts

    learning = cold(8, "predictive")  # the first start, then a few gaps to learn from
    assert learning >= 2
    assert cold(30, "predictive") == learning  # nothing after the eighth waited
    assert cold(30, "kpa") == 30  # KPA lets go after 60 s, so every request waits for a start


def test_wakes_and_starts_come_from_the_tiers_the_model_states():
    trace = (TraceRequest(0.0, 0, 10), TraceRequest(300.0, 0, 10))
    scaling = ScalingConfig(max=1, target_concurrency=1)
    model = replace(SMALL, initial_tier=Tier.OBJECT_STORAGE)
    report = simulate(trace, make_policy("predictive", scaling), scaling=scaling, model=model)
    # 20 s from object storage first; the second request finds the instance asleep: a 1 s wake
    assert (report.starts, report.wakes) == (1, 1)
    assert (report.cold_starts, report.cold_from_wake) == (2, 1)
    assert report.p99_wait_s == pytest.approx(20.0)
    assert report.sleep_seconds > 0
