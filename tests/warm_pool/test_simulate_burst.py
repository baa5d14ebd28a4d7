"""The simulator on a burst at zero (issue 13, item 6): eight requests arrive together with nothing
READY, on a deployment with target concurrency 8 and max 2. One instance serves them all at once,
so one start is all the policy should ask for, however long the requests are held for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from warm_pool.policies import make_policy
from warm_pool.policies.base import ScalingConfig
from warm_pool.profiles import CPU, GPU
from warm_pool.simulate import simulate
from warm_pool.trace import TraceRequest

SCALING = ScalingConfig(max=2, target_concurrency=8)


@pytest.mark.parametrize(
    ("model", "context", "generated"),
    [
        (CPU, 20, 8),  # the CPU engine: an 8.4 s disk start, ~2.7 s of service each
        (replace(CPU, jitter=0.0), 100, 1),  # well under a second of service each
        (GPU, 100, 100),  # vLLM on a GPU: a 28 s disk start, 2.5 s of service each
    ],
)
def test_eight_requests_at_zero_start_one_instance(model, context, generated):
    trace = tuple(TraceRequest(0.0, context, generated) for _ in range(8))
    report = simulate(trace, make_policy("predictive", SCALING), scaling=SCALING, model=model)
    assert (report.served, report.rejected) == (8, 0)
    assert report.starts == 1, report.timeline
    assert max(ready + starting for _, _, _, ready, starting, _, _ in report.timeline) == 1
