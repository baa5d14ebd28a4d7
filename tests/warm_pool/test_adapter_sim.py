"""The adapter tier of the fleet simulator (`warm_pool.adapter_sim`), on scripted traces."""

from __future__ import annotations

import pytest

from warm_pool.adapter_sim import Adapter, Base, simulate_adapters
from warm_pool.errors import InvalidConfig
from warm_pool.fleet_sim import GB
from warm_pool.policies.base import TierTimes
from warm_pool.profiles import InstanceModel
from warm_pool.trace import TraceRequest

LOAD_S = 0.5
# Starts in 2 s, no jitter; a request of 100 + 1 tokens takes 0.035 s: nothing overlaps at 1 s apart.
MODEL = InstanceModel(
    startup=TierTimes(wake=1.0, page_cache=2.0, disk=2.0, object_storage=2.0),
    jitter=0.0,
    adapter_load_s=LOAD_S,
)


def short(*times: float) -> tuple[TraceRequest, ...]:
    return tuple(TraceRequest(t, 100, 1) for t in times)


def run(traces: dict[str, tuple[TraceRequest, ...]], *, bases=("base",), model=MODEL, **kw):
    """Adapter i on base i mod len(bases), the bases 24 GB on two 80 GB devices."""
    adapters = [Adapter(name, bases[i % len(bases)], trace) for i, (name, trace) in enumerate(traces.items())]
    report = simulate_adapters(
        adapters, [Base(b, 24 * GB) for b in bases], devices=2, device_memory=80 * GB, model=model, **kw
    )
    return report, {row.name: row for row in report.adapters}


def test_a_request_waits_for_its_adapter_only_where_the_instance_lacks_it():
    # a@0 starts the instance (2 s) and loads a; a@5 finds it loaded; b@6 loads b; b@6.1 waits for
    # the rest of that load (0.4 s) and does not load it again; b@8 finds it loaded.
    report, rows = run({"a": short(0, 5), "b": short(6, 6.1, 8)})
    a, b = rows["a"], rows["b"]
    assert report.fleet.deployments[0].starts == 1
    assert (a.requests, a.adapter_loads, a.paid_loads, a.slow_cold_starts) == (2, 1, 1, 1)
    assert a.p99_wait_s == pytest.approx(2.0 + LOAD_S)  # the start, then the load
    assert a.p50_wait_s == 0.0  # a@5: loaded already
    assert (b.requests, b.adapter_loads, b.paid_loads, b.slow_cold_starts) == (3, 1, 2, 0)
    assert b.p99_wait_s == pytest.approx(LOAD_S)
    assert b.p50_wait_s == pytest.approx(LOAD_S - 0.1)  # b@6.1, on the load under way
    assert report.fleet.p99_wait_s == pytest.approx(2.0 + LOAD_S)  # the fleet's waits include loads
    assert report.adapter_evictions == 0


@pytest.mark.parametrize(("max_adapters", "loads", "evictions"), [(1, (3, 3), 5), (2, (1, 1), 0)])
def test_alternating_adapters_pay_every_time_when_the_instance_keeps_one(max_adapters, loads, evictions):
    # a@0 starts the instance and loads a, a@5 finds it; from then on a and b take turns.
    times = {"a": short(0, 5, 7, 9), "b": short(6, 8, 10)}
    report, rows = run(times, max_adapters=max_adapters)
    assert report.fleet.deployments[0].starts == 1  # one instance: every request on it
    assert (rows["a"].adapter_loads, rows["b"].adapter_loads) == loads
    assert (rows["a"].paid_loads, rows["b"].paid_loads) == loads
    assert report.adapter_evictions == evictions
    assert rows["b"].p50_wait_s == pytest.approx(LOAD_S if max_adapters == 1 else 0.0)


def test_a_request_goes_to_an_instance_that_holds_its_adapter():
    # One slot an instance: a@0 and b@0.1 (10 s each) get an instance each, a on the first. At b@20
    # both are idle; the least busy is a tie, won by the first, which lacks b: affinity sends b to
    # the other, so b is loaded once (kpa keeps both instances meanwhile).
    model = InstanceModel(startup=MODEL.startup, jitter=0.0, concurrency=1, adapter_load_s=LOAD_S)
    trace = {"a": (TraceRequest(0, 0, 400),), "b": (TraceRequest(0.1, 0, 400), *short(20, 22))}
    adapters = [Adapter(name, "base", t) for name, t in trace.items()]
    report = simulate_adapters(
        adapters, [Base("base", 24 * GB, policy="kpa")], devices=2, device_memory=80 * GB, model=model
    )
    b = report.adapters[1]
    assert report.fleet.deployments[0].starts >= 2
    assert (b.requests, b.adapter_loads, b.paid_loads) == (3, 1, 1)


def steady(offset: float) -> tuple[TraceRequest, ...]:
    """A request every second for 3 min, each 3 s (120 tokens at 40/s): 3 in flight on average."""
    return tuple(TraceRequest(offset + k, 0, 120) for k in range(180))


def test_the_base_scales_on_the_sum_of_its_adapters_traffic():
    model = InstanceModel(startup=MODEL.startup, jitter=0.0, concurrency=8)
    # Each adapter alone keeps 3 of an instance's 8 slots busy: one instance each, on a base each.
    alone, _ = run({"a": steady(0), "b": steady(0.5)}, bases=("x", "y"), model=model)
    assert [d.starts for d in alone.fleet.deployments] == [1, 1]
    # Together on one base, 6 of 8: above the policy's target share of an instance; it sees the
    # sum and runs two.
    together, rows = run({"a": steady(0), "b": steady(0.5)}, model=model)
    assert together.fleet.deployments[0].starts == 2
    assert together.fleet.requests == rows["a"].requests + rows["b"].requests == 360
    assert together.fleet.rejected == 0


def test_an_adapter_on_a_base_that_is_not_there_is_refused():
    with pytest.raises(InvalidConfig, match="no base named 'nope'"):
        simulate_adapters(
            [Adapter("a", "nope", short(0))], [Base("base", 24 * GB)], devices=1, device_memory=80 * GB
        )
    with pytest.raises(InvalidConfig, match="max_adapters"):
        run({"a": short(0)}, max_adapters=0)


def test_a_scheduled_adapter_meets_a_warm_base_once_its_forecast_has_learned_it():
    """A job every 600 s on a base that nothing else calls (the GPU profile: fresh starts of
    20-28 s, wakes of 1 s): with each adapter named to the base's tracker, its requests after the
    learning phase (six periods) find the base READY and the adapter loaded ahead; forecasting
    only the sum, the base is stopped between them and each one pays a fresh start."""
    from warm_pool.profiles import GPU

    job = short(*(600.0 * k for k in range(1, 16)))
    sides = {}
    for forecast in (False, True):
        report = simulate_adapters(
            [Adapter("job", "base", job)], [Base("base", 24 * GB)], devices=1, device_memory=80 * GB,
            model=GPU, forecast=forecast,
        )  # fmt: skip
        late = [t for t in report.slow_at if t > 6 * 600.0]
        sides[forecast] = (len(late), report.prefetched, report.paid_loads)
    assert sides[False] == (9, 0, 15)  # requests 7..15: each a fresh start and a load
    late, prefetched, paid = sides[True]
    assert late == 0 and prefetched >= 9 and paid <= 15 - 9
