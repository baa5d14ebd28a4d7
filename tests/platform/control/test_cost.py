"""Live cost's arithmetic (`stoker.control.cost`, `stoker.control.prices`): tables, and scripts on a logical clock
through the real `PoolMetrics`, `UsageTap` parsing and price table. No processes."""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from stoker.api.cost import parse_since
from stoker.control.arrival_log import ArrivalLog, load_arrivals
from stoker.control.cost import CostMeter, Ledger
from stoker.control.cost_rows import share_adapters, summarize
from stoker.control.prices import PriceError, PriceTable, load_prices
from stoker.errors import APIError
from tests.conftest import STOKER
from tests.deadlines import CLI
from tests.snapshots.support import assert_one_line_error
from warm_pool.metrics import PoolMetrics
from warm_pool.states import InstanceState as S


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- the price table --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "engine", "state", "per_hour"),
    [
        ({}, "cpu", "READY", 3.00),
        ({}, "vllm", "SLEEPING", 0.08),
        ({"ready_hour": 1.2}, "cpu", "STARTING", 1.2),  # starting defaults to ready
        ({"ready_hour": 1.2, "starting_hour": 0.6}, "vllm", "PENDING", 0.6),
        ({"ready_hour": {"cpu": 0.12, "vllm": 3.0}}, "cpu", "DRAINING", 0.12),
        ({"ready_hour": {"default": 2.0, "vllm": 3.0}}, "cpu", "READY", 2.0),
        ({"sleeping_hour": {"default": 0.5}}, "vllm", "SLEEPING", 0.5),
        ({"ready_hour": 9}, "cpu", "FAILED", 9.0),
        ({"ready_hour": 9}, "cpu", "STOPPED", 0.0),
    ],
)
def test_price_per_state_and_engine(data, engine, state, per_hour):
    assert PriceTable.parse(data).per_second(engine, state) * 3600 == pytest.approx(per_hour)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([1, 2], "must be a mapping"),
        ({"ready": 1}, "ready: unknown field (known: ready_hour"),
        ({"ready_hour": -1}, "ready_hour must be a number ≥ 0 ($), got -1"),
        ({"ready_hour": True}, "ready_hour must be a number"),
        ({"ready_hour": "3"}, "ready_hour must be a number"),
        ({"ready_hour": float("nan")}, "ready_hour must be a number"),
        ({"ready_hour": {"tpu": 1}}, "ready_hour.tpu: unknown engine (known: cpu, vllm, default)"),
        ({"ready_hour": {"cpu": 1}}, "ready_hour: no price for engine vllm (give it, or `default`)"),
        ({"sleeping_hour": {"cpu": "x", "vllm": 1}}, "sleeping_hour.cpu must be a number"),
        ({"snapshot_gb_month": None}, "snapshot_gb_month must be a number"),
    ],
)
def test_a_bad_price_table_names_the_field(data, fragment):
    with pytest.raises(PriceError) as err:
        PriceTable.parse(data)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_the_worked_example_of_the_prices_module():
    p = PriceTable.parse(
        {"ready_hour": {"cpu": 0.12, "vllm": 3.0}, "starting_hour": 3.0, "snapshot_gb_month": 0.023}
    )
    cost = (
        1800 * p.per_second("cpu", "READY")
        + 9 * p.per_second("cpu", "STARTING")
        + 3600 * p.per_second("cpu", "SLEEPING")
        + 5409 * p.storage_per_second(270_000_000)
    )
    assert cost == pytest.approx(0.147513, abs=1e-6)


def test_price_files_yaml_json_and_links(tmp_path):
    (tmp_path / "p.yaml").write_text("ready_hour: {cpu: 0.5, vllm: 4}\nsleeping_hour: 0.1\n")
    (tmp_path / "p.json").write_text(json.dumps({"ready_hour": 2}))
    assert load_prices(tmp_path / "p.yaml").ready_hour == {"cpu": 0.5, "vllm": 4.0}
    assert load_prices(tmp_path / "p.json").starting_hour == {"cpu": 2.0, "vllm": 2.0}
    (tmp_path / "link.yaml").symlink_to(tmp_path / "p.yaml")
    (tmp_path / "bad.json").write_text("{")
    for name, fragment in (
        ("link.yaml", "not a regular file (links are not followed)"),
        ("bad.json", "not JSON"),
        ("none.yaml", "no such file"),
    ):
        with pytest.raises(PriceError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            load_prices(tmp_path / name)


# ---- history and the report's arithmetic ------------------------------------------------------------


def test_ledger_sums_whole_minutes_since():
    ledger = Ledger()
    for t, amount in ((0, 1.0), (59, 2.0), (60, 4.0), (150, 8.0), (3600, 16.0)):
        ledger.add(t, {"x": amount})
    assert ledger.sum(None) == {"x": 31.0}
    assert ledger.sum(1) == {"x": 28.0}  # minutes 1, 2 and 60
    assert ledger.sum(60) == {"x": 16.0}
    assert ledger.sum(61) == {}


def test_ledger_keeps_24_hours_of_minutes():
    ledger = Ledger()
    for minute in range(3000):
        ledger.add(minute * 60.0, {"x": 1.0})
    assert len(ledger.minutes) == 1441 and ledger.total == {"x": 3000.0}
    assert ledger.sum(0) == {"x": 1441.0}


@pytest.mark.parametrize(
    ("revisions", "busy", "expect"),
    [
        # The docstring's example: READY 100 s + SLEEPING 50 s, 3 requests of 10 + 20 tokens, busy 6 s.
        (
            {1: {"s:READY": 100, "usd:READY": 0.1, "s:SLEEPING": 50, "usd:SLEEPING": 0.005, "requests": 3,
                 "tokens_in": 30, "tokens_out": 60}},
            6.0,
            {"cost_usd": 0.105, "cost_per_1k_tokens": 1.166667, "cost_per_1k_requests": 35.0, "idle_share": 0.96},
        ),
        # Nothing served: no per-1k figures; starting seconds count in the denominator, not as idle.
        (
            {1: {"s:STARTING": 10, "usd:STARTING": 0.01, "s:READY": 30, "usd:READY": 0.03}},
            0.0,
            {"cost_usd": 0.04, "cost_per_1k_tokens": None, "cost_per_1k_requests": None, "idle_share": 0.75},
        ),
        # Two revisions add up; storage is cost but not time.
        (
            {1: {"s:READY": 10, "usd:READY": 0.5, "requests": 1, "tokens_in": 5, "tokens_out": 5},
             2: {"s:READY": 10, "usd:READY": 0.5, "usd:storage": 0.25, "requests": 1, "tokens_in": 5, "tokens_out": 5}},
            20.0,
            {"cost_usd": 1.25, "cost_per_1k_tokens": 62.5, "cost_per_1k_requests": 625.0, "idle_share": 0.0},
        ),
        ({}, 0.0, {"cost_usd": 0, "cost_per_1k_tokens": None, "cost_per_1k_requests": None, "idle_share": None}),
    ],
)  # fmt: skip
def test_summarize(revisions, busy, expect):
    row = summarize("chat", revisions, {"busy_s": busy})
    assert {k: row[k] for k in expect} == pytest.approx(expect)
    assert [r["revision"] for r in row["revisions"]] == list(revisions)


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, None), ("90", 90.0), ("15m", 900.0), ("24h", 86400.0), ("1s", 1.0)]
)
def test_since_parses(value, seconds):
    assert parse_since(value) == seconds


@pytest.mark.parametrize("value", ["", "soon", "-5m", "25h", "0", "0.5s"])
def test_a_bad_since_is_a_400_naming_it(value):
    with pytest.raises(APIError) as err:
        parse_since(value)
    assert err.value.status == 400 and err.value.param == "since"


# ---- the meter, scripted on a logical clock -----------------------------------------------------------


def _spec(revision: int, engine: str = "cpu", **settings) -> SimpleNamespace:
    from warm_pool.engine_settings import EngineSettings

    return SimpleNamespace(
        name="chat",
        revision=revision,
        engine=engine,
        snapshot_id=f"snap{revision}",
        engine_settings=EngineSettings(**settings),
    )


async def _answer(tap, chunks: list[bytes], status: int = 200) -> None:
    await tap({"type": "http.response.start", "status": status, "headers": []})
    for chunk in chunks:
        await tap({"type": "http.response.body", "body": chunk, "more_body": True})
    await tap({"type": "http.response.body", "body": b"", "more_body": False})


async def _sink(message) -> None:
    pass


async def test_a_script_of_instance_seconds_requests_and_idle(tmp_path):
    clock = Clock(1000.0)
    registry = CollectorRegistry()
    prices = PriceTable.parse({"ready_hour": 3.6, "sleeping_hour": 0.36, "snapshot_gb_month": 2.592})
    meter = CostMeter(
        prices, registry, clock, lambda sid: 10**9 if sid == "snap1" else 0, ArrivalLog(tmp_path)
    )
    inner = PoolMetrics(registry)
    pool = meter.pool_metrics(inner, _spec(1))
    pool.set_instances("chat@1", {S.READY: 1, S.SLEEPING: 0})  # one READY from t=1000
    # Two requests overlap on one instance (1002..1006, 1004..1010): busy is min(n, R) = 1.
    clock.now = 1002.0
    first = meter.tap(_sink, "chat", 7)
    clock.now = 1004.0
    second = meter.tap(_sink, "chat", 7)
    clock.now = 1006.0
    await _answer(
        first, [b'{"choices":[],"usage":{"prompt_tokens":11,"total_tokens":31,"completion_tokens":20}}']
    )
    meter.done(first, {"stoker.revision": 1})
    clock.now = 1010.0
    events = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'] * 4 + [b"data: [DONE]\n\n"]
    await _answer(second, events)  # a stream with no usage: estimate in, one token an event out
    meter.done(second, {"stoker.revision": 1})
    # The pool accounts 20 s READY, then the instance sleeps 40 s.
    clock.now = 1020.0
    pool.add_instance_seconds("chat", S.READY, 20.0)
    pool.set_instances("chat@1", {S.READY: 0, S.SLEEPING: 1})
    clock.now = 1060.0
    pool.add_instance_seconds("chat", S.SLEEPING, 40.0)
    pool.set_instances("chat@1", {S.READY: 0, S.SLEEPING: 1})
    [row] = meter.report()
    ready_usd, sleep_usd, storage_usd = 20 * 0.001, 40 * 0.0001, 60 * 1e-6  # 1 GB at $2.592 a month: $1e-6/s
    assert row["revisions"][0]["storage_usd"] == pytest.approx(storage_usd)
    assert row["cost_usd"] == pytest.approx(ready_usd + sleep_usd + storage_usd)
    assert (row["requests"], row["tokens_in"], row["tokens_out"]) == (2, 11 + 7, 20 + 4)
    assert row["cost_per_1k_tokens"] == pytest.approx(row["cost_usd"] / 42 * 1000, rel=1e-5)
    assert row["cost_per_1k_requests"] == pytest.approx(row["cost_usd"] / 2 * 1000, rel=1e-5)
    busy = 1006 - 1002 + 1010 - 1006  # one instance busy from the first arrival to the last end
    assert row["idle_seconds"] == pytest.approx(20 + 40 - busy)
    assert row["idle_share"] == pytest.approx((60 - busy) / 60)
    # The counters agree, and the pool's own instance-seconds went through unchanged.
    assert registry.get_sample_value(
        "stoker_cost_usd_total", {"deployment": "chat", "revision": "1", "state": "READY"}
    ) == pytest.approx(ready_usd)
    assert (
        registry.get_sample_value(
            "stoker_tokens_total", {"deployment": "chat", "revision": "1", "direction": "out"}
        )
        == 24
    )
    assert (
        registry.get_sample_value(
            "stoker_instance_seconds_total", {"deployment": "chat", "state": "SLEEPING"}
        )
        == 40
    )
    # --since: the minutes that began at or after now - since, rounded down: 1075 - 55 = 1020 is
    # minute 17 (the accruals at 1020 and 1060); 1075 - 60 = 1015 is minute 16 (the requests too).
    clock.now = 1075.0
    [recent] = meter.report(since_s=55)
    assert recent["requests"] == 0 and recent["instance_seconds"] == {"READY": 20.0, "SLEEPING": 40.0}
    [longer] = meter.report(since_s=60)
    assert longer["requests"] == 2
    # The arrival log has both, as a trace: times from the first arrival, tokens in and out.
    trace = load_arrivals(tmp_path / "arrivals.jsonl")
    assert [(r.context_tokens, r.generated_tokens) for r in trace] == [(11, 20), (7, 4)]


async def test_a_request_refused_before_a_revision_took_it_counts_nothing():
    meter = CostMeter(PriceTable(), CollectorRegistry(), Clock())
    meter.pool_metrics(PoolMetrics(CollectorRegistry()), _spec(1))
    tap = meter.tap(_sink, "chat", 5)
    await _answer(tap, [b'{"error": {}}'], status=429)
    meter.done(tap, {})
    assert meter.tap(_sink, "assist", 5) is None  # not a deployment here (a cascade route)
    [row] = meter.report()
    assert row["requests"] == 0 and row["tokens_in"] == 0


# ---- the command line's bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["cost", "--since", "soon"], "argument --since: 'soon' is not a duration"),
        (["cost", "--since", "25h"], "--since must be at least 1s and at most 24h"),
        (
            ["up", "--prices", "PRICES"],
            "--prices PRICES: ready_hour.tpu: unknown engine (known: cpu, vllm, default)",
        ),
        (["up", "--prices", "NONE"], "--prices NONE: no such file"),
        (["cost"], "cannot"),  # nothing listens at STOKER_URL: one line saying so
    ],
)
def test_bad_cost_input_is_one_line(tmp_path, args, fragment):
    prices = tmp_path / "p.yaml"
    prices.write_text("ready_hour: {tpu: 1}\n")
    names = {"PRICES": str(prices), "NONE": str(tmp_path / "none.yaml")}
    args = [names.get(a, a) for a in args]
    fragment = fragment.replace("PRICES", str(prices)).replace("NONE", str(tmp_path / "none.yaml"))
    env = {**os.environ, "STOKER_URL": "http://127.0.0.1:1", "STOKER_HOME": str(tmp_path / "home")}
    env.pop("STOKER_ADMIN_KEY", None)
    proc = subprocess.run([STOKER, *args], capture_output=True, text=True, timeout=CLI, env=env)
    assert_one_line_error(proc, fragment)


def test_the_price_table_knows_every_engine_a_deployment_can_name():
    from stoker.control import prices
    from stoker.spec import deployment

    assert tuple(prices.ENGINES) == tuple(deployment.ENGINES)


def test_an_instance_on_several_gpus_costs_each_of_them(tmp_path):
    prices = PriceTable.parse({"ready_hour": 3.6})  # $0.001 a device-second
    meter = CostMeter(prices, CollectorRegistry(), Clock(0.0), lambda sid: 0, ArrivalLog(tmp_path))
    wide, one = _spec(1, "vllm", gpus=4), _spec(1, "vllm")  # the default: one device
    wide.name, one.name = "wide", "one"
    for spec in (wide, one):
        pool = meter.pool_metrics(PoolMetrics(CollectorRegistry()), spec)
        pool.add_instance_seconds(spec.name, S.READY, 10.0)
        pool.add_instance_seconds(spec.name, S.SLEEPING, 100.0)  # host memory, per instance: once
    cost = {row["deployment"]: row["cost_usd"] for row in meter.report()}
    asleep = 100 * 0.08 / 3600  # the default sleeping price
    assert cost == pytest.approx({"wide": 4 * 10 * 0.001 + asleep, "one": 10 * 0.001 + asleep})


# ---- adapters: a share of their base's cost -----------------------------------------------------------


def _row(name: str, cost: float, storage: float, tokens: int, load_s: float = 0.0) -> dict:
    return {
        "deployment": name,
        "cost_usd": cost,
        "storage_usd": storage,
        "requests": 1,
        "tokens_in": tokens,
        "tokens_out": 0,
        "load_seconds": load_s,
    }


def test_adapters_take_their_tokens_share_and_their_loads_and_the_rows_add_up():
    """The docstring's worked example of `share_adapters`."""
    rows = [_row("b", 1.00, 0.10, 600), _row("a1", 0.0, 0.0, 300, 2.0), _row("a2", 0.0, 0.0, 100)]
    b, a1, a2 = share_adapters(rows, {"a1": "b", "a2": "b"}, lambda base: 0.01)
    assert a1["cost_usd"] == pytest.approx(0.88 * 0.3 + 0.02) and a1["load_usd"] == pytest.approx(0.02)
    assert a2["cost_usd"] == pytest.approx(0.088) and a2["base"] == "b" and "base" not in b
    assert b["cost_usd"] == pytest.approx(0.628) and b["adapters_usd"] == pytest.approx(0.372)
    assert b["cost_usd"] + a1["cost_usd"] + a2["cost_usd"] == pytest.approx(1.00)
    assert a1["cost_per_1k_tokens"] == pytest.approx(a1["cost_usd"] / 300 * 1000, rel=1e-6)


def test_loads_priced_past_the_base_cost_are_scaled_to_it_and_no_tokens_leaves_the_base_its_cost():
    [b, a1] = share_adapters(
        [_row("b", 0.05, 0.0, 0), _row("a1", 0.0, 0.0, 0, 10.0)], {"a1": "b"}, lambda _: 0.01
    )
    assert a1["cost_usd"] == pytest.approx(0.05) and b["cost_usd"] == pytest.approx(0.0)
    [b, a1] = share_adapters([_row("b", 0.05, 0.0, 0), _row("a1", 0.0, 0.0, 0)], {"a1": "b"}, lambda _: 0.01)
    assert a1["cost_usd"] == 0 and b["cost_usd"] == pytest.approx(0.05)
    # an adapter whose base has no row (removed, or never ran) keeps what it has
    [a1] = share_adapters([_row("a1", 0.0, 0.0, 50)], {"a1": "gone"}, lambda _: 0.01)
    assert a1["cost_usd"] == 0 and "base" not in a1


async def test_an_adapters_requests_are_its_own_and_busy_time_of_its_base(tmp_path):
    clock = Clock(1000.0)
    registry = CollectorRegistry()
    prices = PriceTable.parse({"ready_hour": 3.6, "sleeping_hour": 0.36, "snapshot_gb_month": 0.0})
    meter = CostMeter(prices, registry, clock, lambda sid: 0, ArrivalLog(tmp_path))
    pool = meter.pool_metrics(PoolMetrics(registry), _spec(1))
    pool.set_instances("chat@1", {S.READY: 1, S.SLEEPING: 0})
    meter.adapter("a1", "chat")
    assert meter.tap(_sink, "a2", 7) is None  # no base known: a name with no pool here
    clock.now = 1002.0
    tap = meter.tap(_sink, "a1", 7)
    meter.adapter_loaded("a1", 1, 0.5)
    clock.now = 1006.0
    await _answer(tap, [b'{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":10}}'])
    meter.done(tap, {"stoker.revision": 1})
    clock.now = 1010.0
    pool.add_instance_seconds("chat", S.READY, 10.0)
    pool.set_instances("chat@1", {S.READY: 1, S.SLEEPING: 0})
    rows = {row["deployment"]: row for row in meter.report()}
    a1, chat = rows["a1"], rows["chat"]
    assert (a1["requests"], a1["tokens_in"], a1["tokens_out"], a1["load_seconds"]) == (1, 10, 10, 0.5)
    assert chat["requests"] == 0 and chat["idle_seconds"] == pytest.approx(10 - 4)  # a1's 4 s were busy
    # all of the base's tokens were a1's: it pays for the base's 10 READY seconds, its load included
    assert a1["cost_usd"] == pytest.approx(10 * 0.001) and a1["load_usd"] == pytest.approx(0.5 * 0.001)
    assert chat["cost_usd"] == pytest.approx(0.0) and chat["adapters_usd"] == pytest.approx(0.01)
    assert (
        registry.get_sample_value(
            "stoker_tokens_total", {"deployment": "a1", "revision": "1", "direction": "out"}
        )
        == 10
    )
