"""A restarted controller pre-warms on the schedule it had learned: the code trace through the
predictive policy, once straight through and once restarted half-way, its policy state carried
through the real checkpoint (JSON text, every field read back and checked) into the second half.

How the simulator models the restart (`warm_pool.simulate.Restart`): at the first tick at or after
the restart point the policy's state becomes what the checkpoint gave back; the instances carry
on, as a restarted controller that adopts them finds them, and so do the tracker's measurements.
Only what the checkpoint holds is put to the test, and a restart without it (the initial state, as
a controller that kept nothing starts) must do measurably worse on the same trace, or the test
could not fail.

An engine without sleep mode (vLLM's CPU build: every way back is a 30 s start) is where the
learned idle-gap histogram decides the most: between bursts the last instance is stopped and
started again at the pre-warm point it learned, or, with nothing learned yet, kept READY for the
fallback and then stopped, so the next burst waits for a start. With sleep mode the way back is a
wake, and on this trace no policy state changes the slow starts (GPU profile, thinned by 10, max 4:
none after the restart point in any of the three runs). The figures are beside each case.

    PYTHONPATH=platform:. python -m pytest -q tests/warm_pool/test_simulate_restart.py
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from warm_pool.policies.base import ScalingConfig, Tier
from warm_pool.policies.checkpoint import decode, encode
from warm_pool.policies.rules import RuledState
from warm_pool.policies.settings import bind_policy
from warm_pool.profiles import GPU, VLLM_CPU
from warm_pool.simulate import Restart, Simulation
from warm_pool.trace import load_trace

TRACE = (
    Path(__file__).resolve().parents[1] / "data" / "azure-llm-code-2023-first29min.csv"
)  # the shared trace
WALL = 1_764_568_800.0  # wall − clock, the same on both sides: the simulator has one clock


def through_checkpoint(state: RuledState) -> RuledState:
    text = json.dumps(encode("predictive", state, WALL), allow_nan=False)
    return decode("predictive", json.loads(text), WALL)


def slow_after(trace, model, scaling, carry=None) -> int:
    """Requests arriving after the restart point (half-way) that waited for a start, not a wake."""
    at_s = trace[-1].t / 2
    policy = bind_policy("predictive", scaling)  # as the pool binds a deployment's
    restart = None
    if carry is not None:
        restart = Restart(at_s, through_checkpoint if carry == "restored" else lambda s: policy.initial_state)
    sim = Simulation(trace, policy, model=model, scaling=scaling, restart=restart)
    sim.run()
    return sum(
        1
        for r, tier in zip(trace, sim.cold_tiers, strict=True)
        if r.t >= at_s and tier not in (None, Tier.WAKE)
    )


@pytest.mark.parametrize(
    ("model", "thin", "expected"),
    [
        # never restarted 0, restored 0, not restored 5
        pytest.param(VLLM_CPU, 50, (0, 0, 5), id="vllm-cpu-code-thin50"),
        # the GPU profile without sleep mode: 13, 13, 18
        pytest.param(replace(GPU, can_sleep=False), 50, (13, 13, 18), id="gpu-nosleep-code-thin50"),
    ],
)
def test_a_restored_controller_prewarms_as_the_one_that_never_restarted(model, thin, expected):
    trace = load_trace(TRACE, thin=thin)
    scaling = ScalingConfig(max=2, target_concurrency=16)
    straight = slow_after(trace, model, scaling)
    restored = slow_after(trace, model, scaling, "restored")
    initial = slow_after(trace, model, scaling, "initial")
    assert abs(restored - straight) <= 1
    assert initial >= straight + 3  # forgetting what it learned costs slow starts
    assert (straight, restored, initial) == expected  # deterministic: the figures reported


def test_a_restart_that_keeps_the_state_as_it_is_changes_nothing_and_happens_once():
    trace = load_trace(TRACE, thin=50)
    scaling = ScalingConfig(max=2, target_concurrency=16)
    calls: list[RuledState] = []

    def keep(state: RuledState) -> RuledState:
        calls.append(state)
        return state

    def run(restart):
        return Simulation(
            trace, bind_policy("predictive", scaling), model=VLLM_CPU, scaling=scaling, restart=restart
        ).run()

    assert run(Restart(600.0, keep)) == run(None)
    assert len(calls) == 1
