"""Prefix affinity through the activator, with real upstreams on loopback: requests that share a
system prompt land on one instance; a hot prefix spills to the other only past the load bound; held
requests and retries keep their key; a body with no prompt still goes through."""

from __future__ import annotations

import asyncio
import json

from activator import Balance
from activator.affinity import request_key
from activator.balancer import pick_by_prefix
from tests.activator.conftest import Ep, MemorySource, Rig, closed_port, eventually

BALANCE = Balance("prefix", bound=1.25, prefix_chars=64)


def chat(system: str, user: str) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def system_homed_at(id_: str, endpoints: list[Ep]) -> str:
    """A system prompt (longer than the key) whose requests go to `id_` when nothing is outstanding."""
    for i in range(1000):
        system = f"You are assistant number {i}. Answer briefly and politely, in plain English. " * 2
        key = request_key(json.dumps(chat(system, "q")).encode(), BALANCE)
        if pick_by_prefix(endpoints, {}, key, BALANCE.bound).id == id_:
            return system
    raise AssertionError(f"no system prompt goes to {id_}")


def alternate(ids: list[str]) -> bool:
    """a b a b or b a b a: least-outstanding's turns between two idle instances."""
    return ids in (["a", "b"] * (len(ids) // 2), ["b", "a"] * (len(ids) // 2))


def systems_seen(upstream) -> list[str]:
    return [r["messages"][0]["content"] for r in upstream.requests]


async def test_same_prefix_same_instance_where_least_outstanding_alternates(rig: Rig) -> None:
    eps = [Ep("a", rig.a_url), Ep("b", rig.b_url)]
    activator = rig.activator(MemorySource(eps))
    to_a, to_b = system_homed_at("a", eps), system_homed_at("b", eps)

    least = [await rig.client.post("/v1/chat/completions", json=chat(to_a, f"q{i}")) for i in range(4)]
    assert alternate([r.headers["x-stoker-instance"] for r in least])  # ties take turns

    activator.set_balance(BALANCE)
    got = {}
    for system in (to_a, to_b):
        answers = [
            await rig.client.post("/v1/chat/completions", json=chat(system, f"q{i}")) for i in range(6)
        ]
        assert all(r.status_code == 200 for r in answers)
        got[system] = {r.headers["x-stoker-instance"] for r in answers}
    assert got == {to_a: {"a"}, to_b: {"b"}}


async def test_a_hot_prefix_spills_only_past_the_bound_under_concurrency(rig: Rig) -> None:
    eps = [Ep("a", rig.a_url), Ep("b", rig.b_url)]
    activator = rig.activator(MemorySource(eps))
    activator.set_balance(BALANCE)
    system = system_homed_at("a", eps)
    rig.a.before_headers, rig.b.before_headers = asyncio.Event(), asyncio.Event()  # nothing finishes
    calls = [
        asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=chat(system, f"q{i}")))
        for i in range(8)
    ]
    await eventually(lambda: activator.load().in_flight == 8)
    # Each grant's capacity is ceil(1.25 × (outstanding + 1) / 2): a takes the 1st, 2nd, 4th, 5th
    # and 7th, b the 3rd, 6th and 8th. Never more than ceil(1.25 × 8 / 2) = 5.
    assert activator.load().outstanding == {"a": 5, "b": 3}
    rig.a.before_headers.set()
    rig.b.before_headers.set()
    answers = await asyncio.gather(*calls)
    assert all(r.status_code == 200 for r in answers)
    assert len(rig.a.requests) == 5 and len(rig.b.requests) == 3


async def test_held_requests_keep_their_key_when_instances_arrive(rig: Rig) -> None:
    eps = [Ep("a", rig.a_url), Ep("b", rig.b_url)]
    source = MemorySource()
    activator = rig.activator(source)
    activator.set_balance(BALANCE)
    to_a, to_b = system_homed_at("a", eps), system_homed_at("b", eps)
    calls = []
    for i, system in enumerate((to_a, to_a, to_b, to_b)):  # least-outstanding would mix them: a b a b
        calls.append(
            asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=chat(system, f"q{i}")))
        )
        await eventually(lambda n=i + 1: activator.load().queued == n)
    source.eps.extend(eps)
    activator.capacity_changed()
    answers = await asyncio.gather(*calls)
    assert all(r.status_code == 200 for r in answers)
    assert systems_seen(rig.a) == [to_a, to_a] and systems_seen(rig.b) == [to_b, to_b]


async def test_a_retry_goes_to_the_next_instance_on_the_ring(rig: Rig) -> None:
    dead = Ep("a", f"http://127.0.0.1:{closed_port()}")
    eps = [dead, Ep("b", rig.b_url)]
    source = MemorySource(eps)
    activator = rig.activator(source)
    activator.set_balance(BALANCE)
    answer = await rig.client.post("/v1/chat/completions", json=chat(system_homed_at("a", eps), "q"))
    assert answer.status_code == 200 and answer.headers["x-stoker-instance"] == "b"
    assert source.failures == ["a"]


async def test_a_body_with_no_prompt_goes_to_the_least_loaded(rig: Rig) -> None:
    eps = [Ep("a", rig.a_url), Ep("b", rig.b_url)]
    activator = rig.activator(MemorySource(eps))
    activator.set_balance(BALANCE)
    odd = [
        {"model": "m", "prompt": 5},
        {"model": "m", "messages": [{"role": "user", "content": 5}]},
        {"model": "m", "messages": []},
        {"model": "m"},
    ]
    answers = [await rig.client.post("/v1/completions", json=body) for body in odd]
    assert [r.status_code for r in answers] == [200] * 4
    assert alternate([r.headers["x-stoker-instance"] for r in answers])
