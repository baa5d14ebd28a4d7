"""Prefix affinity, the pure parts: `Balance`, the prefix key of a body, and `pick_by_prefix`
(consistent hashing with bounded loads). Tables, and sequences of grants and releases drawn from a
seeded generator: no time, no I/O."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from activator.affinity import Balance, prompt_prefix, request_key
from activator.balancer import POINTS, Ring, capacity, pick_by_prefix, point
from tests.activator.conftest import Ep

PREFIX = Balance("prefix", prefix_chars=64)
SYSTEM = "You are a careful assistant for the billing team. Answer in one sentence. " * 3


def chat(system: str, user: str) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def key_of(body: dict, balance: Balance = PREFIX) -> int | None:
    return request_key(json.dumps(body).encode(), balance)


def home(key: int, endpoints: list[Ep], ring: Ring | None = None) -> str:
    """Where `key` goes when nothing is outstanding: its instance on the ring."""
    return pick_by_prefix(endpoints, {}, key, 1.25, ring).id


def key_homed_at(id_: str, endpoints: list[Ep]) -> int:
    ring = Ring.of(e.id for e in endpoints)
    return next(k for k in (point(f"probe {i}") for i in range(1000)) if home(k, endpoints, ring) == id_)


# ---- Balance -----------------------------------------------------------------------------------------


def test_balance_defaults_to_least_outstanding() -> None:
    assert Balance() == Balance("least-outstanding", 1.25, 512)
    assert not Balance().by_prefix and Balance("prefix").by_prefix


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "round-robin"}, "balance mode must be one of least-outstanding, prefix, got 'round-robin'"),
        ({"bound": 0.99}, "affinity bound must be a number in [1.0, 10.0], got 0.99"),
        ({"bound": 10.5}, "got 10.5"),
        ({"bound": math.nan}, "got nan"),
        ({"bound": True}, "got True"),
        ({"bound": "1.5"}, "got '1.5'"),
        ({"prefix_chars": 15}, "prefix_chars must be an integer in [16, 1000000], got 15"),
        ({"prefix_chars": 64.0}, "got 64.0"),
    ],
)
def test_balance_refuses_bad_values_quoting_them(kwargs, message) -> None:
    with pytest.raises(ValueError) as info:
        Balance(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("bound", [1, 1.0, 1.25, 10])
def test_balance_accepts_the_range(bound) -> None:
    assert Balance("prefix", bound).bound == bound


# ---- the key -----------------------------------------------------------------------------------------


def test_the_key_is_a_stable_hash() -> None:
    # blake2b, not hash(): the same in every process, so every gateway replica agrees.
    assert point("abc") == 15617099051652453721
    assert key_of({"prompt": "abc"}, Balance("prefix", prefix_chars=16)) == point("abc")


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        # The shared system prompt is longer than the key: the questions after it do not count.
        (chat(SYSTEM, "What is my balance?"), chat(SYSTEM, "How do I pay?"), True),
        (chat(SYSTEM, "x"), chat("Another system prompt entirely. " * 5, "x"), False),
        # Text parts read as the string they add up to.
        (
            chat(SYSTEM, "q"),
            {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]},
            True,
        ),
        # Roles are part of the layout.
        (
            {"messages": [{"role": "system", "content": "hello " * 20}]},
            {"messages": [{"role": "user", "content": "hello " * 20}]},
            False,
        ),
        # Completions: the first 64 characters.
        ({"prompt": "p" * 64 + "one"}, {"prompt": "p" * 64 + "two"}, True),
        ({"prompt": "p" * 63 + "1"}, {"prompt": "p" * 63 + "2"}, False),
        ({"prompt": ["batch first", "second"]}, {"prompt": "batch first"}, True),
        ({"prompt": [1, 2, 3]}, {"prompt": [[1, 2, 3]]}, True),
        ({"prompt": [1, 2, 3]}, {"prompt": [1, 2, 4]}, False),
        ({"prompt": [*range(100), 7]}, {"prompt": [*range(100), 8]}, True),  # 64 // 4 ids
    ],
)
def test_same_prefix_same_key(a, b, same) -> None:
    ka, kb = key_of(a), key_of(b)
    assert ka is not None and kb is not None
    assert (ka == kb) is same


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'"a string"',
        b"{}",
        b'{"messages": []}',
        b'{"messages": "hello"}',
        b'{"messages": [1]}',
        b'{"messages": [{"content": "no role"}]}',
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"messages": [{"role": "user", "content": {"text": "a dict"}}]}',
        b'{"messages": [{"role": "user", "content": ["a bare string part"]}]}',
        b'{"messages": [{"role": "user", "content": [{"text": "no type"}]}]}',
        b'{"prompt": ""}',
        b'{"prompt": 5}',
        b'{"prompt": []}',
        b'{"prompt": [1, "x"]}',
        b'{"prompt": [{"a": 1}]}',
        b'{"prompt": [true, false]}',
        b"[" * 100_000 + b"]" * 100_000,  # too deep for json: RecursionError
    ],
)
def test_a_body_with_no_readable_prompt_has_no_key(body: bytes) -> None:
    assert request_key(body, PREFIX) is None  # least-outstanding takes it


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (chat("S", "U"), "<|system|>\nS\n<|user|>\nU\n"),
        ({"messages": [{"role": "assistant", "content": None}]}, "<|assistant|>\n\n"),  # a tool call
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image_url"}]}
                ]
            },
            "<|user|>\nsee <image_url>\n",
        ),
        ({"prompt": "x" * 100}, "x" * 64),
        ({"messages": [{"role": "user", "content": "q"}], "prompt": "ignored"}, "<|user|>\nq\n"),
    ],
)
def test_how_the_prompt_is_laid_out(body, text) -> None:
    assert prompt_prefix(body, 64) == text


def test_a_parsed_body_is_used_as_is() -> None:
    assert request_key(b"", PREFIX, {"prompt": "abc"}) == key_of({"prompt": "abc"})
    assert request_key(b"", PREFIX, {"prompt": 5}) is None


# ---- consistent hashing with bounded loads -----------------------------------------------------------

A, B, C = Ep("a", "u", 8), Ep("b", "u", 8), Ep("c", "u", 8)


@pytest.mark.parametrize(
    ("total", "instances", "bound", "expected"),
    [
        (0, 2, 1.25, 1),  # ceil(1.25 × 1 / 2)
        (7, 2, 1.25, 5),  # the module's worked example
        (5, 2, 1.25, 4),  # ceil(3.75)
        (3, 4, 1.0, 1),
        (5, 2, 2.0, 6),
        (99, 3, 1.5, 50),
    ],
)
def test_capacity(total, instances, bound, expected) -> None:
    assert capacity(total, instances, bound) == expected


def test_no_endpoints_none() -> None:
    assert pick_by_prefix([], {}, 123, 1.25) is None


def test_all_full_none() -> None:
    assert pick_by_prefix([A, B], {"a": 8, "b": 8}, 123, 10.0) is None


def test_same_key_same_instance_whatever_the_order_of_endpoints() -> None:
    for i in range(50):
        key = point(f"k{i}")
        assert len({home(key, order) for order in ([A, B, C], [C, B, A], [B, C, A])}) == 1


def test_keys_spread_over_the_instances() -> None:
    endpoints = [Ep(f"i{n}", "u", 10**6) for n in range(4)]
    ring = Ring.of(e.id for e in endpoints)
    counts = Counter(home(point(f"key {i}"), endpoints, ring) for i in range(4000))
    assert len(counts) == 4
    assert all(900 <= c <= 1100 for c in counts.values()), counts  # a quarter each, within 10%


def test_the_ring_places_each_id_at_its_points() -> None:
    ring = Ring.of(["a", "b"])
    assert len(ring.points) == 2 * POINTS and list(ring.points) == sorted(ring.points)
    assert Counter(ring.owners) == {"a": POINTS, "b": POINTS}
    assert ring.places([B, A]) and not ring.places([A]) and not ring.places([A, B, C])
    assert Ring.of(["b", "a"]) == ring


@pytest.mark.parametrize(
    ("outstanding", "bound", "expected"),
    [
        ({}, 1.25, "home"),
        ({"home": 3, "away": 1}, 1.25, "home"),  # capacity ceil(1.25 × 5 / 2) = 4: 3 is below
        ({"home": 4, "away": 1}, 1.25, "away"),  # capacity ceil(1.25 × 6 / 2) = 4: full by the bound
        ({"home": 4, "away": 1}, 2.0, "home"),  # capacity 6
        ({"home": 1, "away": 0}, 1.0, "away"),  # capacity 1: a bound of 1 is perfectly even
        ({"home": 8, "away": 30}, 10.0, "away"),  # home is full at its max_concurrency (8)
        ({"home": 8, "away": 100}, 10.0, None),  # both full
    ],
)
def test_bounded_loads(outstanding, bound, expected) -> None:
    endpoints = [Ep("home", "u", 8), Ep("away", "u", 100)]
    key = key_homed_at("home", endpoints)
    chosen = pick_by_prefix(endpoints, outstanding, key, bound)
    assert (chosen.id if chosen else None) == expected


def test_an_endpoint_left_out_is_passed_by_on_the_same_ring() -> None:
    key = key_homed_at("a", [A, B, C])
    ring = Ring.of(["a", "b", "c"])
    chosen = pick_by_prefix([B, C], {}, key, 1.25, ring)  # `a` excluded (a retry after it failed)
    assert chosen.id == home(key, [B, C])


def test_when_every_instance_below_the_bound_is_full_another_with_room_takes_it() -> None:
    # a: full at its max_concurrency of 1; b: 5 of 8, at the capacity ceil(1.25 × 7 / 2) = 5.
    small, big = Ep("a", "u", 1), Ep("b", "u", 8)
    key = key_homed_at("a", [small, big])
    assert pick_by_prefix([small, big], {"a": 1, "b": 5}, key, 1.25).id == "b"


@pytest.mark.parametrize(("instances", "bound"), [(2, 1.25), (3, 1.0), (4, 1.25), (5, 2.0)])
def test_the_bound_holds_at_every_grant_with_one_hot_prefix_and_a_few_cold(instances, bound) -> None:
    endpoints = [Ep(f"i{n}", "u", 10**6) for n in range(instances)]
    rng = random.Random(7)
    ring = Ring.of(e.id for e in endpoints)
    hot = point("the one system prompt everyone sends")
    outstanding: dict[str, int] = {}
    running: list[str] = []
    for _ in range(2000):
        if running and rng.random() < 0.45:  # a request ends
            done = running.pop(rng.randrange(len(running)))
            outstanding[done] -= 1
            continue
        key = hot if rng.random() < 0.8 else point(str(rng.random()))
        total = sum(outstanding.values())
        chosen = pick_by_prefix(endpoints, outstanding, key, bound, ring)
        outstanding[chosen.id] = outstanding.get(chosen.id, 0) + 1
        running.append(chosen.id)
        assert outstanding[chosen.id] <= capacity(total, instances, bound)
    assert len(running) > 10 * instances  # the load did build up


def test_a_hot_prefix_spills_only_past_the_bound() -> None:
    # 8 requests of one prefix on 2 instances, none finishing: 5 on its own, 3 on the other.
    outstanding: dict[str, int] = {}
    key = key_homed_at("a", [A, B])
    for _ in range(8):
        chosen = pick_by_prefix([A, B], outstanding, key, 1.25)
        outstanding[chosen.id] = outstanding.get(chosen.id, 0) + 1
    assert outstanding == {"a": 5, "b": 3}


def test_an_instance_joining_or_leaving_moves_a_small_share_of_keys() -> None:
    four = [Ep(f"i{n}", "u", 10**6) for n in range(4)]
    five = [*four, Ep("i4", "u", 10**6)]
    keys = [point(f"key {i}") for i in range(4000)]
    ring4, ring5 = Ring.of(e.id for e in four), Ring.of(e.id for e in five)
    before = {k: home(k, four, ring4) for k in keys}
    joined = {k: home(k, five, ring5) for k in keys}
    moved = [k for k in keys if before[k] != joined[k]]
    assert all(joined[k] == "i4" for k in moved)  # only onto the newcomer ...
    assert 0.15 <= len(moved) / len(keys) <= 0.25  # ... about a fifth of them
    ring = Ring.of(e.id for e in four[1:])
    left = {k: home(k, four[1:], ring) for k in keys}  # i0 leaves
    assert all(left[k] == before[k] for k in keys if before[k] != "i0")  # only its keys move
