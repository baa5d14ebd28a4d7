"""`warm_pool.policies.checkpoint`: every policy's learned state through JSON and back, exactly, on the
same clock and on a clock whose origin moved; every field checked on the way in; and the pool taking
a state back only for its own policy."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import fields, replace
from pathlib import Path

import pytest

from tests.warm_pool.policy_script import obs, second
from warm_pool.policies import POLICIES, make_policy
from warm_pool.policies.adapter_forecast import AdapterTrack
from warm_pool.policies.base import ScalingConfig, SecondSample
from warm_pool.policies.checkpoint import decode, encode, fits
from warm_pool.policies.forecast import DayProfile, Forecast
from warm_pool.policies.histogram import HistogramState
from warm_pool.policies.keepalive import KeepaliveState
from warm_pool.policies.kpa import KpaState
from warm_pool.policies.predictive import PredictiveState
from warm_pool.policies.reactive import PolicyState
from warm_pool.policies.rules import RuledState
from warm_pool.profiles import GPU
from warm_pool.simulate import Restart, Simulation
from warm_pool.trace import load_trace

TRACE = Path(__file__).resolve().parents[1] / "data" / "azure-llm-code-2023-first29min.csv"
SCALING = ScalingConfig(max=4, target_concurrency=16)
WALL = 1_764_568_800.0  # wall − clock at the checkpoint: a monotonic clock's origin is boot


def learned(name: str, at_s: float = 900.0) -> RuledState:
    """The state policy `name` has learned `at_s` seconds into the code trace (thinned by 10), as
    the simulator's real tracker fed it."""
    seen: list[RuledState] = []
    policy = make_policy(name, SCALING)
    restart = Restart(at_s, lambda state: seen.append(state) or state)
    Simulation(load_trace(TRACE, thin=10), policy, model=GPU, scaling=SCALING, restart=restart).run()
    return seen[0]


def through_json(name: str, state: RuledState, to_wall: float, back: float) -> RuledState:
    text = json.dumps(encode(name, state, to_wall), allow_nan=False)
    return decode(name, json.loads(text), back)


@pytest.fixture(scope="module")
def states() -> dict[str, RuledState]:
    return {name: learned(name) for name in POLICIES}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_state_comes_back_exactly_and_decides_the_same(name, states):
    state = states[name]
    assert state != POLICIES[name].state() and state != RuledState(inner=POLICIES[name].state())
    back = through_json(name, state, WALL, WALL)
    assert back == state
    # ... and from there, the same decisions as the state that never left.
    policy = make_policy(name, SCALING)
    a, b = state, back
    for t in range(901, 1000):
        o = obs(seconds=(second(t - 1, 3.0, arrivals=2),), in_flight=3, ready=1, last_arrival=t - 0.5)
        da, a = policy.decide(o, a, float(t))
        db, b = policy.decide(o, b, float(t))
        assert da == db


def test_the_predictive_state_learned_from_a_trace_has_every_part():
    inner = learned("predictive").inner
    assert inner.forecast.holt.seen > 0 and inner.histogram.total > 0
    assert any(not math.isnan(r) for r in inner.forecast.profile.rates)  # 15 minutes of slots
    assert inner.readies and inner.samples and inner.forecast.profile.slot_start is not None


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_clock_whose_origin_moved_sees_the_same_state_at_the_same_wall_time(name, states):
    # Saved at clock 900 = WALL + 900; restored on a clock that reads 12 at the same wall time
    # (a reboot: its origin is 888 s later, a whole number of profile slots plus 48 s). The
    # restored state, asked at clock 12 + k, decides as the old one at 900 + k.
    shift = -888.0
    state = states[name]
    back = through_json(name, state, WALL, WALL - shift)
    policy = make_policy(name, SCALING)
    a, b = state, back
    for t in range(901, 960):
        samples = (second(t - 1, 2.0, arrivals=1),)
        o = obs(seconds=samples, in_flight=2, ready=1, last_arrival=t - 0.5, idle_since=None)
        moved = replace(
            o,
            seconds=tuple(s._replace(start=s.start + shift) for s in samples),
            last_arrival=o.last_arrival + shift,
        )
        da, a = policy.decide(o, a, float(t))
        db, b = policy.decide(moved, b, float(t) + shift)
        assert (da.ready, da.sleeping, da.warm) == (db.ready, db.sleeping, db.warm)
        assert da.forecast == pytest.approx(db.forecast) if da.forecast is not None else db.forecast is None


def test_the_time_of_day_profile_turns_by_whole_slots_with_the_clock():
    rates = tuple(float(i) for i in range(1440))
    state = RuledState(PredictiveState(forecast=Forecast(profile=DayProfile(rates, 100.0, 540.0, 7))))
    # A new origin 600 s (10 slots) later: the slot of wall time w was index i, is now i - 10.
    back = through_json("predictive", state, 0.0, 600.0).inner.forecast.profile
    assert back.rates[0] == 10.0 and back.rates[-10] == 0.0
    assert (back.first, back.slot_start, back.count) == (-500.0, -60.0, 7)
    # 29 s off a whole slot: to the nearest one; the slot being counted stays on a slot's edge.
    back = through_json("predictive", state, 0.0, 629.0).inner.forecast.profile
    assert back.rates[0] == 10.0 and back.slot_start == -60.0 and back.first == -529.0


def test_every_state_field_is_known_to_the_codec():
    # A field added to a state needs its place in warm_pool/policies/checkpoint.py first.
    assert [f.name for f in fields(RuledState)] == ["inner", "last_ready", "last_up", "last_down"]
    assert [f.name for f in fields(PredictiveState)] == [
        "forecast",
        "histogram",
        "readies",
        "samples",
        "held",
        "queued",
        "adapters",
    ]
    assert [f.name for f in fields(AdapterTrack)] == ["last", "gaps", "window", "per_hit", "named"]
    assert [f.name for f in fields(KpaState)] == ["samples", "panic_since", "panic_peak", "zero_since"]
    assert [f.name for f in fields(KeepaliveState)] == ["peaks"]
    assert [f.name for f in fields(HistogramState)] == ["histogram", "peaks"]
    assert [f.name for f in fields(PolicyState)] == ["history", "last_active", "last_desired"]
    assert [f.name for f in fields(Forecast)] == ["holt", "profile"]
    assert [f.name for f in fields(DayProfile)] == ["rates", "first", "slot_start", "count"]
    assert SecondSample._fields == ("start", "arrivals", "concurrency")


def _set(doc: dict, path: str, value) -> dict:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    at = out
    for key in parents:
        at = at[int(key)] if isinstance(at, list) else at[key]
    if value is KeyError:
        del at[last]
    elif isinstance(at, list):
        at[int(last)] = value
    else:
        at[last] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "fragment"),
    [
        ("rules.last_ready", -1, "rules.last_ready: want a whole number ≥ 0"),
        ("rules.last_ready", True, "rules.last_ready: want a whole number"),
        ("rules.last_up", "soon", "rules.last_up: want a finite number"),
        ("rules.extra", 1, "unknown ['extra']"),
        ("inner.holt", KeyError, "missing ['holt']"),
        ("inner.holt.level", 1e400, "inner.holt.level: want a finite number"),
        ("inner.holt.seen", 10**9, "inner.holt.seen: want at most 31"),
        ("inner.histogram.counts", [1.0, 2.0], "want 0 or 600 bins, got 2"),
        ("inner.histogram.counts.3", -1.0, "inner.histogram.counts[3]: want a number ≥ 0"),
        ("inner.histogram.out_of_range", None, "out_of_range: want a finite number, got None"),
        ("inner.profile.rates", [0.0] * 7, "want 0 or 1440 slots, got 7"),
        ("inner.profile.slot_s", 30.0, "slots of 30.0 s in a day of 86400.0 s, not 60 in 86400"),
        ("inner.profile.count", 2.5, "inner.profile.count: want a whole number"),
        ("inner.readies", [[5.0, 1], [4.0, 0]], "inner.readies[1]: times must not go back"),
        ("inner.readies", [[5.0]], "inner.readies[0]: want 2 items, got 1"),
        ("inner.samples", [[1.0, -2, 0.5]], "inner.samples[0][1]: want a whole number ≥ 0"),
        ("inner.samples", [[0.0, 0, 0.0]] * 10_001, "more than any state holds (10000)"),
        ("inner.queued", [1.0, 2, 3], "inner.queued: want 2 items, got 3"),
        ("inner", [], "inner: want an object, got list"),
    ],
)
def test_a_bad_field_is_refused_naming_it(path, value, fragment, states):
    doc = encode("predictive", states["predictive"], WALL)
    with pytest.raises(ValueError, match="policy predictive state") as err:
        decode("predictive", _set(doc, path, value), WALL)
    assert fragment in str(err.value)


def test_another_policy_s_state_or_an_unknown_policy_is_refused(states):
    with pytest.raises(ValueError, match="missing"):
        decode("kpa", encode("predictive", states["predictive"], WALL), WALL)
    with pytest.raises(ValueError, match="not one this version has"):
        decode("oracle", encode("kpa", states["kpa"], WALL), WALL)
    with pytest.raises(TypeError, match="not the state of policy kpa"):
        encode("kpa", states["predictive"], WALL)


def test_a_state_fits_only_its_own_policy_and_sizes(states):
    predictive = make_policy("predictive", SCALING)
    assert fits("predictive", states["predictive"], predictive.config)
    assert not fits("kpa", states["predictive"], make_policy("kpa", SCALING).config)
    fewer_bins = replace(predictive.config, histogram=replace(predictive.config.histogram, range_s=300.0))
    assert not fits("predictive", states["predictive"], fewer_bins)


def test_a_pool_takes_back_only_a_state_of_its_own_policy(tmp_path, states):
    from prometheus_client import CollectorRegistry

    from snapshots import SnapshotStore
    from warm_pool.backends.memory import MemoryBackend
    from warm_pool.metrics import PoolMetrics
    from warm_pool.pool import Pool, PoolSpec
    from warm_pool.snapshot import SnapshotSource

    source = SnapshotSource(SnapshotStore(tmp_path / "store"), "0" * 64)
    spec = PoolSpec("d", source, scaling=SCALING, policy="predictive")
    pool = Pool(spec, MemoryBackend(), PoolMetrics(CollectorRegistry()), clock=lambda: 0.0)
    initial = make_policy("predictive", SCALING).initial_state
    assert not pool.restore_policy("kpa", states["kpa"])
    assert pool.saved_policy() == ("predictive", initial)
    assert pool.restore_policy("predictive", states["predictive"])
    assert pool.saved_policy() == ("predictive", states["predictive"])
