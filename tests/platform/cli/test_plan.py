"""`stoker.cli.plan`: capacity from a bench by Little's law, as tables. No clock, no platform: the
samples are written out, so every figure below can be checked by hand."""

from __future__ import annotations

import math

import pytest

from stoker.cli.plan import Level, PlanError, Sample, levels, parse_redundancy, percentile, plan, summarize


def level(c: int, ttft_p99: float, e2e: float, n: int = 10) -> Level:
    return Level(in_flight=c, requests=n, ttft_p99_s=ttft_p99, ttft_p50_s=ttft_p99 / 2, e2e_mean_s=e2e)


# Four levels: TTFT grows with load; service time too. Per instance: 1/0.5 = 2, 2/0.6 = 3.33,
# 4/0.8 = 5, 8/1.6 = 5 req/s.
MEASURED = [level(1, 0.10, 0.5), level(2, 0.20, 0.6), level(4, 0.40, 0.8), level(8, 1.50, 1.6)]


@pytest.mark.parametrize(
    ("qps", "target", "kwargs", "want"),
    [
        # C = 4 (level 8's 1.5 s misses 0.5 s), W = 0.8: ceil(20 × 0.8 / 4) = 4.
        (20, 0.5, {}, dict(concurrency=4, base_instances=4, instances=4, max_instances=4, devices=4)),
        # Exactly on a whole number stays there (4.000000000000001 in floats is 4).
        (5, 0.5, {}, dict(concurrency=4, base_instances=1, instances=1)),
        # N+1: one spare, in min_warm and max alike.
        (20, 0.5, {"redundancy": 1}, dict(base_instances=4, instances=5, max_instances=5)),
        # A looser target reaches level 8: ceil(20 × 1.6 / 8) = 4.
        (20, 2.0, {}, dict(concurrency=8, service_time_s=1.6, base_instances=4)),
        # A tighter one stops at level 1: ceil(20 × 0.5 / 1) = 10.
        (20, 0.15, {}, dict(concurrency=1, base_instances=10)),
        # The peak sizes max: ceil(50 × 0.8 / 4) + 1 = 11; min_warm stays with Q.
        (20, 0.5, {"peak_qps": 50, "redundancy": 1}, dict(instances=5, max_instances=11)),
        # Devices: 5 instances, 2 a device → 3 (11 at max → 6).
        (20, 0.5, {"peak_qps": 50, "redundancy": 1, "instances_per_device": 2}, dict(devices=3, devices_at_max=6)),
        # A trickle still gets one instance.
        (0.01, 0.5, {}, dict(base_instances=1, instances=1)),
    ],
)  # fmt: skip
def test_littles_law(qps, target, kwargs, want):
    p = plan(MEASURED, qps=qps, p99_ttft_s=target, **kwargs)
    for field, value in want.items():
        assert getattr(p, field) == pytest.approx(value), field
    assert p.base_instances == max(1, math.ceil(qps * p.service_time_s / p.concurrency - 1e-9))
    assert (p.target_concurrency, p.min_warm) == (p.concurrency, p.instances)
    assert p.per_instance_rps == pytest.approx(p.concurrency / p.service_time_s)


def test_a_level_with_too_few_requests_is_no_evidence_either_way():
    # Level 2 has one slow request: skipped, so C = 4 still.
    measured = [level(1, 0.1, 0.5), level(2, 9.0, 0.6, n=1), level(4, 0.4, 0.8)]
    assert plan(measured, qps=20, p99_ttft_s=0.5).concurrency == 4
    # Counted with --min-samples 1, it stops the climb at 1.
    assert plan(measured, qps=20, p99_ttft_s=0.5, min_samples=1).concurrency == 1


def test_a_miss_stops_the_climb_even_if_a_higher_level_meets_the_target():
    measured = [level(1, 0.1, 0.5), level(2, 0.9, 0.6), level(4, 0.4, 0.8)]
    assert plan(measured, qps=20, p99_ttft_s=0.5).concurrency == 1


@pytest.mark.parametrize(
    ("measured", "kwargs", "fragment"),
    [
        (MEASURED, {"p99_ttft_s": 0.05}, "a p99 TTFT of 0.05 s cannot be met: at 1 in flight per instance"),
        ([level(3, 2.0, 1.0)], {"p99_ttft_s": 1.0}, "bench at a lower rate"),
        ([level(1, 0.1, 0.5, n=2)], {"p99_ttft_s": 1.0}, "no in-flight level with 5 or more"),
        ([], {"p99_ttft_s": 1.0}, "(it has: none)"),
        (MEASURED, {"p99_ttft_s": 0.5, "qps": 0}, "--qps must be a number > 0"),
        (MEASURED, {"p99_ttft_s": 0.5, "qps": math.inf}, "--qps must be a number > 0"),
        (MEASURED, {"p99_ttft_s": 0.0}, "--p99-ttft must be more than 0 s"),
        (MEASURED, {"p99_ttft_s": 0.5, "peak_qps": 10}, "--peak-qps must be at least --qps (20)"),
        (MEASURED, {"p99_ttft_s": 0.5, "instances_per_device": 0}, "--instances-per-device must be 1 or more"),
        (MEASURED, {"p99_ttft_s": 0.5, "min_samples": 0}, "--min-samples must be 1 or more"),
        (MEASURED, {"p99_ttft_s": 0.5, "qps": 1000}, "needs 200 instances, more than one deployment may have (64)"),
    ],
)  # fmt: skip
def test_refusals(measured, kwargs, fragment):
    kwargs = {"qps": 20, **kwargs}
    with pytest.raises(PlanError) as caught:
        plan(measured, **kwargs)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("text", "want"), [("N+1", 1), ("n+0", 0), ("N + 2", 2), ("3", 3)])
def test_redundancy(text, want):
    assert parse_redundancy(text) == want


@pytest.mark.parametrize("text", ["N+", "N-1", "M+1", "2N", "-1", ""])
def test_bad_redundancy(text):
    with pytest.raises(ValueError, match="is not a redundancy: give N\\+K"):
        parse_redundancy(text)


@pytest.mark.parametrize(
    ("values", "p", "want"),
    [([], 99, None), ([3.0], 99, 3.0), ([1, 2, 3, 4], 50, 2), ([1, 2, 3, 4], 99, 4), (list(range(1, 201)), 99, 198)],
)  # fmt: skip
def test_percentile_is_nearest_rank(values, p, want):
    assert percentile(values, p) == want


def warm(start, e2e, instance="a", ttft=0.1, tokens=5):
    return Sample(start=start, ttft=ttft, e2e=e2e, tokens=tokens, instance=instance, cold=False)


def test_levels_count_in_flight_per_instance_at_each_send():
    samples = [
        # One instance up from t=0. Sent at 0, 1 (joins the one at 0), 1.5 (joins both), 5 (alone).
        warm(0.0, 2.0),
        warm(1.0, 2.0),
        warm(1.5, 2.0, instance=None, ttft=1.0),  # held in the activator: no instance header
        warm(5.0, 1.0),
        # A cold one starts a second instance, up by its first token at 6.5: it is not a sample
        # itself, but it is in flight from 6, and the instance counts from 6.5.
        Sample(start=6.0, ttft=0.5, e2e=2.0, tokens=5, instance="b", cold=True),
        warm(7.0, 1.0, instance="b"),  # 2 in flight (the cold one and itself) over 2 instances: 1
        Sample(
            start=7.2, ttft=None, e2e=None, tokens=0, instance=None, cold=False, error="HTTP 503 queue_full"
        ),
    ]
    got = {lv.in_flight: (lv.requests, lv.e2e_mean_s) for lv in levels(samples)}
    assert got == {1: (3, pytest.approx(4 / 3)), 2: (1, 2.0), 3: (1, 2.0)}


def test_summary_figures():
    samples = [
        warm(0.0, 1.0, ttft=0.2, tokens=5),  # TPOT (1.0 − 0.2) / 4 = 0.2
        warm(1.0, 2.0, ttft=0.5, tokens=4, instance="b"),  # TPOT 0.5
        Sample(start=2.0, ttft=3.0, e2e=4.0, tokens=1, instance="a", cold=True),  # one token: no TPOT
        Sample(start=3.0, ttft=None, e2e=None, tokens=0, instance=None, cold=False, error="timeout"),
    ]
    s = summarize(samples, wall_s=10.0)
    assert (s["requests"], s["answered"], s["errors"], s["error_kinds"]) == (4, 3, 1, {"timeout": 1})
    assert (s["cold_starts"], s["instances_seen"]) == (1, 2)
    assert s["throughput_rps"] == pytest.approx(0.3) and s["output_tokens_per_s"] == pytest.approx(1.0)
    assert (s["ttft_p50_s"], s["ttft_p99_s"], s["ttft_warm_p99_s"]) == (0.5, 3.0, 0.5)
    assert (s["tpot_p50_s"], s["tpot_p99_s"]) == (pytest.approx(0.2), pytest.approx(0.5))
    assert (s["e2e_p50_s"], s["e2e_p99_s"]) == (2.0, 4.0)
    # Little: Σ e2e / wall = 7 / 10 in flight on average, over 2 instances.
    assert s["mean_in_flight"] == pytest.approx(0.7) and s["in_flight_per_instance"] == pytest.approx(0.35)


def test_samples_round_trip_through_json():
    s = Sample(start=1.25, ttft=0.5, e2e=2.0, tokens=7, instance="x", cold=True)
    assert Sample.from_json(s.to_json()) == s
