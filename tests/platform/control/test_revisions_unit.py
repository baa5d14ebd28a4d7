"""Revisions without processes: the registry's history and traffic, the split's layout, the canary
verdict on a logical clock."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

import pytest

from stoker.control.registry import Registry
from stoker.control.rollout import _to_100
from stoker.errors import APIError
from stoker.gateway.revisions import BUCKETS, Answer, bucket_of, canary_verdict, choose
from stoker.spec.deployment import DeploymentSpec, validate
from stoker.spec.traffic import parse_traffic

SPEC = DeploymentSpec(name="chat", model="a", snapshot_id="a" * 64)


# ---- the registry ------------------------------------------------------------------------------


async def test_every_deploy_is_a_numbered_immutable_revision(tmp_path) -> None:
    registry = Registry(tmp_path / "stoker.db")
    first = await registry.put(SPEC)
    second = await registry.create_revision(replace(SPEC, model="b", snapshot_id="b" * 64))
    assert (first.revision, second.revision) == (1, 2)
    assert registry.traffic("chat") == {1: 100}  # a new revision takes no traffic by itself
    registry.set_traffic("chat", {2: 100})
    third = await registry.put(replace(SPEC, max=3))
    assert third.revision == 3 and registry.traffic("chat") == {3: 100}
    history = registry.revisions("chat")
    assert [(s.revision, s.snapshot_id[0], s.max) for s, _ in history] == [
        (1, "a", 1),
        (2, "b", 1),
        (3, "a", 3),
    ]
    assert registry.revision("chat", 2) == second
    assert registry.all() == [third]
    registry.set_traffic("chat", {1: 10, 3: 90})
    assert [s.revision for s in registry.serving()] == [1, 3]


async def test_a_switch_under_way_is_kept_until_it_ends_and_outlives_a_restart(tmp_path) -> None:
    """What a controller restarted in the middle of a canary resumes (`Rollout.resume`)."""
    registry = Registry(tmp_path / "stoker.db")
    await registry.put(SPEC)
    assert registry.pending_switch("chat") is None
    registry.set_pending_switch("chat", (2, 50))
    registry.close()
    again = Registry(tmp_path / "stoker.db")
    assert again.pending_switch("chat") == (2, 50)
    again.set_pending_switch("chat", None)
    assert again.pending_switch("chat") is None
    again.set_pending_switch("chat", (3, 100))
    await again.delete("chat")
    assert again.pending_switch("chat") is None


async def test_a_removed_deployment_takes_its_history_and_numbering_restarts(tmp_path) -> None:
    registry = Registry(tmp_path / "stoker.db")
    await registry.put(SPEC)
    await registry.put(SPEC)
    await registry.delete("chat")
    assert registry.revisions("chat") == [] and registry.traffic("chat") == {}
    assert (await registry.put(SPEC)).revision == 1


async def test_a_database_from_before_revisions_reads_as_revision_1_with_all_the_traffic(tmp_path) -> None:
    db = sqlite3.connect(tmp_path / "stoker.db")
    db.execute(
        "CREATE TABLE deployments (name TEXT PRIMARY KEY, spec TEXT NOT NULL, created_at REAL NOT NULL,"
        " updated_at REAL NOT NULL)"
    )
    old = {k: v for k, v in SPEC.to_dict().items() if k in ("name", "model", "snapshot_id", "max", "policy")}
    db.execute("INSERT INTO deployments VALUES (?, ?, 1.0, 1.0)", ("chat", json.dumps(old)))
    db.commit()
    db.close()
    registry = Registry(tmp_path / "stoker.db")
    assert registry.traffic("chat") == {1: 100}
    [(spec, created)] = registry.revisions("chat")
    assert spec.revision == 1 and spec.snapshot_id == SPEC.snapshot_id and created == 1.0
    assert (await registry.put(SPEC)).revision == 2


async def test_a_failed_write_leaves_no_half_revision(tmp_path) -> None:
    registry = Registry(tmp_path / "stoker.db")
    await registry.put(SPEC)
    registry._db.execute(
        "CREATE TRIGGER refuse BEFORE UPDATE ON deployments BEGIN SELECT RAISE(ABORT, 'disk'); END"
    )
    with pytest.raises(sqlite3.DatabaseError):
        await registry.put(replace(SPEC, max=2))
    assert [s.revision for s, _ in registry.revisions("chat")] == [1]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"balance": "round-robin"}, "balance"),
        ({"auto_rollback": "yes"}, "auto_rollback"),
        ({"rollback_error_rate": 1.5}, "rollback_error_rate"),
        ({"rollback_window_s": 0}, "rollback_window_s"),
        ({"affinity_bound": 0.5}, "affinity_bound"),
        ({"rollback_min_requests": 0}, "rollback_min_requests"),
    ],
)
def test_revision_settings_are_validated_naming_the_field(body, field) -> None:
    with pytest.raises(APIError) as err:
        validate({"name": "chat", "model": "a", **body})
    assert err.value.status == 400 and err.value.param == field


# ---- the split ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "must be an object"),
        ([["1", 100]], "must be an object"),
        ({"x": 100}, "revision numbers"),
        ({"9": 100}, "does not exist"),
        ({"1": 50.5, "2": 49.5}, "whole numbers"),
        ({"1": True}, "whole numbers"),
        ({"1": 60, "2": 60}, "sum to 100"),
        ({"1": 0, "2": 0}, "sum to 100"),
    ],
)
def test_a_bad_split_is_a_400_naming_traffic(value, message) -> None:
    with pytest.raises(APIError) as err:
        parse_traffic(value, {1, 2})
    assert err.value.status == 400 and err.value.param == "traffic" and message in err.value.message


def test_a_split_leaves_out_revisions_given_nothing() -> None:
    assert parse_traffic({"1": 0, "2": 100}, {1, 2}) == {2: 100}


def test_one_user_sees_one_revision_and_a_growing_canary_moves_only_the_users_it_takes() -> None:
    users = [bucket_of({"user": f"user-{i}"}, []) for i in range(2000)]
    assert users == [bucket_of({"user": f"user-{i}"}, []) for i in range(2000)]  # deterministic
    at_10 = [choose({1: 90, 2: 10}, b) for b in users]
    at_30 = [choose({1: 70, 2: 30}, b) for b in users]
    assert 100 < at_10.count(2) < 300 and 450 < at_30.count(2) < 750
    assert all(after == 2 for before, after in zip(at_10, at_30, strict=True) if before == 2)
    # the session header outranks the user field; neither: placed at random
    assert bucket_of({"user": "a"}, [(b"x-stoker-session", b"s1")]) == bucket_of(
        {"user": "b"}, [(b"x-stoker-session", b"s1")]
    )
    assert bucket_of({}, []) is None and bucket_of({"user": 7}, []) is None
    assert choose({1: 50, 2: 50}, None, rand=lambda: 0.0) == 1
    assert choose({1: 50, 2: 50}, None, rand=lambda: 0.9999) == 2
    assert choose({3: 100}, BUCKETS - 1) == 3


def test_shares_taken_from_a_failed_canary_go_back_to_the_rest_summing_to_100() -> None:
    assert _to_100({1: 90}) == {1: 100}
    assert _to_100({1: 30, 2: 30}) == {1: 50, 2: 50}
    assert sum(_to_100({1: 33, 2: 33, 3: 1}).values()) == 100


# ---- the canary's verdict, on a logical clock --------------------------------------------------

CANARY = replace(
    SPEC, auto_rollback=True, rollback_error_rate=0.2, rollback_window_s=60, rollback_min_requests=5
)


def answers(*spec: tuple[float, bool, float | None]) -> list[Answer]:
    return [Answer(at, error, ttft) for at, error, ttft in spec]


@pytest.mark.parametrize(
    ("seen", "settings", "now", "failed"),
    [
        # too few answers to tell, however bad
        (answers(*[(t, True, None) for t in range(4)]), {}, 10, None),
        # 2 of 5 failed: 40 % > 20 %
        (
            answers((1, True, None), (2, True, None), (3, False, 0.1), (4, False, 0.1), (5, False, 0.1)),
            {},
            10,
            "5xx on 40%",
        ),
        # 1 of 5: 20 % is not over 20 %
        (answers((1, True, None), *[(t, False, 0.1) for t in range(2, 6)]), {}, 10, None),
        # the failures fell out of the window: only 4 answers left in it
        (answers((1, True, None), (2, True, None), *[(t, False, 0.1) for t in range(70, 74)]), {}, 75, None),
        # no TTFT objective: slow answers are fine
        (answers(*[(t, False, 9.0) for t in range(5)]), {}, 10, None),
        # with one: 5 of 5 slower than 1 s
        (
            answers(*[(t, False, 9.0) for t in range(5)]),
            {"rollback_ttft_s": 1.0},
            10,
            "first byte later than 1s",
        ),
        (answers(*[(t, False, 0.5) for t in range(5)]), {"rollback_ttft_s": 1.0}, 10, None),
    ],
)
def test_the_canary_verdict(seen, settings, now, failed) -> None:
    verdict = canary_verdict(seen, replace(CANARY, **settings), now)
    if failed is None:
        assert verdict is None
    else:
        assert verdict is not None and failed in verdict


# ---- a warming revision's deadline ---------------------------------------------------------------


async def test_a_revision_that_never_warms_fails_at_its_deadline_though_no_start_failed():
    """Its starts wait for ever (no room on a shared device, say): no failure is counted, yet after
    the warm timeout the switch fails, so its traffic stays where it was."""
    from types import SimpleNamespace

    from stoker.control.rollout import Rollout, _Failed

    ticks = iter(range(0, 10_000, 100))  # each look at the clock: 100 s later
    platform = SimpleNamespace(unavailable_after=3, clock=lambda: float(next(ticks)))
    pool = SimpleNamespace(unavailable=None, failed_starts=0, last_failure=None)
    unit = SimpleNamespace(ready=1, pool=pool)
    rollout = Rollout(platform, poll_s=0, warm_timeout_s=450)
    with pytest.raises(_Failed, match=r"1 of 2 instance\(s\) READY after 450s"):
        await rollout._until_ready(unit, 2)
    unit.ready = 2  # READY in time: no failure
    await Rollout(platform, poll_s=0, warm_timeout_s=450)._until_ready(unit, 2)


async def test_back_to_a_revision_still_draining_warms_a_fresh_unit_once_it_is_gone():
    """A rollback right after a switch: revision 1's unit is being stopped. The switch waits for
    it to go, then warms a new one, rather than waiting on the unit being stopped until the warm
    timeout (a rollback that never lands)."""
    import asyncio
    from types import SimpleNamespace

    from stoker.control.deployment import Deployment
    from stoker.control.rollout import Rollout

    def unit(spec, ready):
        pool = SimpleNamespace(
            unavailable=None, failed_starts=0, last_failure=None, reconfigure=lambda *a: None
        )
        return SimpleNamespace(spec=spec, ready=ready, pool=pool, activator=None, demand=None)

    one, two = SPEC, replace(SPEC, model="b", snapshot_id="b" * 64, revision=2)
    one = replace(one, revision=1)
    draining, made = unit(one, 1), []
    stopped = asyncio.Event()

    def new_unit(spec, min_warm=None):
        made.append(spec.revision)
        return unit(spec, 1)

    async def stop_unit(u):
        await stopped.wait()

    pending: dict = {}  # the registry's switch under way
    platform = SimpleNamespace(
        unavailable_after=3,
        clock=lambda: 0.0,
        hold_deadline_s=1.0,
        registry=SimpleNamespace(
            set_traffic=lambda name, traffic: None,
            pending_switch=pending.get,
            set_pending_switch=pending.__setitem__,
        ),
        revision_metrics=SimpleNamespace(set_traffic=lambda *a: None),
        routes=SimpleNamespace(bump=lambda: None),
        new_unit=new_unit,
        stop_unit=stop_unit,
        pool_gone=lambda u: None,
        scaling=lambda spec, min_warm=None: None,
    )
    rollout = Rollout(platform, poll_s=0)
    d = Deployment("chat", two, {1: draining, 2: unit(two, 1)}, {2: 100}, SimpleNamespace())
    rollout._retire(d, 1)  # revision 1 drains after the switch to 2
    await asyncio.sleep(0)
    rollout.switch_to(d, one)  # the rollback
    await asyncio.sleep(0.05)
    assert d.traffic == {2: 100} and made == [] and d.notes[1] == "warming"  # waits for the drain
    stopped.set()
    if d.switch is not None:
        await asyncio.wait_for(d.switch, 5)
    for _ in range(100):
        if d.traffic == {1: 100}:
            break
        await asyncio.sleep(0.01)
    assert made == [1] and d.traffic == {1: 100} and d.units[1] is not draining
    assert pending == {"chat": None}  # the switch ended: none to resume
    await asyncio.gather(*d.leaving.values())
