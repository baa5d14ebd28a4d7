"""The sleep-state reconciliation's pure parts as tables (what a mismatch means; what an answer
says), and `SleepStates`, the background asking, against real HTTP servers on loopback with its
interval moved on a fake clock."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.activator.conftest import closed_port, eventually
from tests.deadlines import deadline
from warm_pool.errors import InvalidConfig
from warm_pool.reconcile import (
    MAX_BODY_BYTES,
    Correction,
    Observed,
    SleepStates,
    correction,
    read_answer,
)
from warm_pool.states import Instance, InstanceState

S, Ob, C = InstanceState, Observed, Correction


@pytest.mark.parametrize(
    ("believed", "observed", "expected"),
    [
        # settled and agreeing: nothing to do
        (S.READY, Ob.AWAKE, C.NONE),
        (S.SLEEPING, Ob.ASLEEP, C.NONE),
        # slept by someone else: out of routing, and the policy wakes or stops it
        (S.READY, Ob.ASLEEP, C.TO_SLEEPING),
        # woken by someone else: it serves, and holds its memory anyway, so into routing
        (S.SLEEPING, Ob.AWAKE, C.TO_READY),
        # another key than ours: nobody of ours can call it
        (S.READY, Ob.UNAUTHORIZED, C.REPLACE),
        (S.SLEEPING, Ob.UNAUTHORIZED, C.REPLACE),
        # no answer is no news: liveness is the activator's
        (S.READY, Ob.UNKNOWN, C.NONE),
        (S.SLEEPING, Ob.UNKNOWN, C.NONE),
        # not settled: whatever the engine says, something is in flight
        *(
            (state, observed, C.NONE)
            for state in (S.PENDING, S.STARTING, S.DRAINING, S.FAILED, S.STOPPED)
            for observed in Ob
        ),
    ],
)
def test_what_a_mismatch_means(believed: InstanceState, observed: Observed, expected: Correction) -> None:
    assert correction(believed, observed) is expected


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, b'{"is_sleeping": true}', Ob.ASLEEP),
        (200, b'{"is_sleeping": false}', Ob.AWAKE),
        (200, b'{"is_sleeping":false,"level":1}', Ob.AWAKE),  # more fields: fine
        (401, b'{"error": {"message": "Missing or invalid API key."}}', Ob.UNAUTHORIZED),
        (401, b"", Ob.UNAUTHORIZED),
        (404, b"Not Found", Ob.UNKNOWN),  # vLLM outside dev mode has no such route
        (503, b'{"is_sleeping": true}', Ob.UNKNOWN),
        (403, b"", Ob.UNKNOWN),
        (200, b'{"is_sleeping": 1}', Ob.UNKNOWN),  # a number is not a bool
        (200, b'{"is_sleeping": "true"}', Ob.UNKNOWN),
        (200, b'{"sleeping": true}', Ob.UNKNOWN),
        (200, b"[true]", Ob.UNKNOWN),
        (200, b"true", Ob.UNKNOWN),
        (200, b"not json", Ob.UNKNOWN),
        (200, b"\xff\xfe", Ob.UNKNOWN),
        (200, b"", Ob.UNKNOWN),
        (200, b'{"is_sleeping": true, "pad": "' + b"x" * MAX_BODY_BYTES + b'"}', Ob.UNKNOWN),  # too big
    ],
)
def test_what_an_answer_says(status: int, body: bytes, expected: Observed) -> None:
    assert read_answer(status, body) is expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interval_s": 0},
        {"interval_s": -1},
        {"interval_s": float("inf")},
        {"timeout_s": 0},
        {"concurrency": 0},
    ],
)
def test_settings_out_of_range_are_refused_naming_the_value(kwargs: dict) -> None:
    [value] = kwargs.values()
    with pytest.raises(InvalidConfig, match=f"got {re.escape(repr(value))}$"):
        SleepStates(lambda: 0.0, **kwargs)


# ---- the asking, against real HTTP on loopback ---------------------------------------------------------


@dataclass
class Engines:
    """Stand-in engines answering `GET /is_sleeping` as told: one HTTP site per instance, each on
    its own loopback port, as the pool's engines are."""

    runner: web.AppRunner
    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # instance id → status, body
    keys: dict[str, str] = field(default_factory=dict)  # instance id → the Authorization it got
    ports: dict[int, str] = field(default_factory=dict)  # port → instance id
    hits: int = 0
    gate: asyncio.Event | None = None  # while set to an Event, answers wait for it

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        instance_id = self.ports[request.transport.get_extra_info("sockname")[1]]
        self.keys[instance_id] = request.headers.get("authorization", "")
        if self.gate is not None:
            await self.gate.wait()
        status, body = self.answers[instance_id]
        return web.Response(status=status, body=body)

    async def instance(self, instance_id: str, secret: str = "k") -> Instance:
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.ports[port] = instance_id
        return Instance(instance_id, "d", 0.0, 8, port=port, secret=secret)


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    app = web.Application()
    runner = web.AppRunner(app, access_log=None)
    engines = Engines(runner)
    app.router.add_get("/is_sleeping", engines.handle)
    await runner.setup()
    yield engines
    if engines.gate is not None:
        engines.gate.set()
    await runner.cleanup()


async def round_of(states: SleepStates) -> dict[str, Observed]:
    await eventually(lambda: not states.in_flight, timeout_s=deadline(10))
    return {seen.instance_id: seen.observed for seen in states.collect()}


async def test_each_engine_is_asked_with_its_own_key_and_its_answer_read(engines: Engines) -> None:
    engines.answers = {
        "a": (200, b'{"is_sleeping": true}'),
        "b": (200, b'{"is_sleeping": false}'),
        "c": (401, b"{}"),
        "d": (404, b"Not Found"),
    }
    states = SleepStates(lambda: 0.0)
    try:
        instances = [await engines.instance(i, secret=f"key-{i}") for i in "abcd"]
        states.start(instances)
        assert await round_of(states) == {
            "a": Ob.ASLEEP,
            "b": Ob.AWAKE,
            "c": Ob.UNAUTHORIZED,
            "d": Ob.UNKNOWN,
        }
        assert engines.keys == {i: f"Bearer key-{i}" for i in "abcd"}
        assert states.collect() == []  # handed back once
    finally:
        await states.aclose()


async def test_the_answer_carries_the_transitions_the_instance_had_when_asked(engines: Engines) -> None:
    engines.answers = {"a": (200, b'{"is_sleeping": false}')}
    inst = await engines.instance("a")
    inst.move_to(S.STARTING, 1.0)
    inst.move_to(S.READY, 2.0)
    states = SleepStates(lambda: 0.0)
    try:
        states.start([inst])
        inst.move_to(S.SLEEPING, 3.0)  # moved while the question was out
        await eventually(lambda: not states.in_flight, timeout_s=deadline(10))
        [seen] = states.collect()
        assert (seen.transitions, inst.transitions) == (2, 3)
    finally:
        await states.aclose()


async def test_one_round_at_a_time_and_one_per_interval_on_the_clock(engines: Engines) -> None:
    engines.answers = {"a": (200, b'{"is_sleeping": false}')}
    engines.gate = asyncio.Event()
    clock = [0.0]
    states = SleepStates(lambda: clock[0], interval_s=5.0)
    inst = await engines.instance("a")
    try:
        states.start([inst])
        await eventually(lambda: engines.hits == 1)
        clock[0] = 60.0  # long due, but the first round still waits for its answer
        states.start([inst])
        assert states.collect() == [] and states.in_flight
        await asyncio.sleep(0.05)
        assert engines.hits == 1
        engines.gate.set()
        assert await round_of(states) == {"a": Ob.AWAKE}
        states.start([inst])  # due: the last round began at 0.0
        assert await round_of(states) == {"a": Ob.AWAKE}
        clock[0] = 64.9  # the last round began at 60.0
        states.start([inst])
        assert not states.in_flight
        clock[0] = 65.0
        states.start([inst])
        assert await round_of(states) == {"a": Ob.AWAKE}
        assert engines.hits == 3
    finally:
        await states.aclose()


async def test_no_answer_in_time_is_unknown_and_the_round_still_ends(engines: Engines) -> None:
    engines.answers = {"slow": (200, b'{"is_sleeping": true}')}
    engines.gate = asyncio.Event()  # never set while the round runs: "slow" never answers
    states = SleepStates(lambda: 0.0, timeout_s=0.2)
    try:
        states.start([await engines.instance("slow")])
        assert await round_of(states) == {"slow": Ob.UNKNOWN}
    finally:
        await states.aclose()


async def test_a_refused_connection_is_unknown(engines: Engines) -> None:
    inst = Instance("gone", "d", 0.0, 8, port=closed_port())
    states = SleepStates(lambda: 0.0)
    try:
        states.start([inst])
        assert await round_of(states) == {"gone": Ob.UNKNOWN}
    finally:
        await states.aclose()


async def test_nothing_to_ask_starts_no_round_and_a_closed_one_starts_none(engines: Engines) -> None:
    engines.answers = {"a": (200, b'{"is_sleeping": false}')}
    states = SleepStates(lambda: 0.0)
    states.start([])
    assert not states.in_flight and states.collect() == []
    engines.gate = asyncio.Event()
    inst = await engines.instance("a")
    states.start([inst])
    await eventually(lambda: engines.hits == 1)
    await states.aclose()  # cancels the round in flight
    assert not states.in_flight and states.collect() == []
    states.start([inst])
    assert not states.in_flight
