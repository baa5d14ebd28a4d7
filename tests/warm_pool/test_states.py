"""The lifecycle's edges as a table, and an instance's accounting of the seconds it spends in each."""

from __future__ import annotations

import itertools

import pytest

from warm_pool.errors import InvalidTransition, PoolError
from warm_pool.states import Instance, InstanceState, new_instance_id, transition

S = InstanceState
ALLOWED = {
    (S.PENDING, S.STARTING),
    (S.STARTING, S.READY),
    (S.READY, S.SLEEPING),
    (S.SLEEPING, S.READY),
    (S.READY, S.DRAINING),
    (S.SLEEPING, S.DRAINING),
    (S.DRAINING, S.STOPPED),
    (S.PENDING, S.STOPPED),  # cancelled before the process existed
    (S.STARTING, S.STOPPED),  # cancelled while loading
    (S.PENDING, S.FAILED),
    (S.STARTING, S.FAILED),
    (S.READY, S.FAILED),
    (S.SLEEPING, S.FAILED),
    (S.DRAINING, S.FAILED),
    (S.FAILED, S.STOPPED),
}


@pytest.mark.parametrize(("current", "new"), list(itertools.product(S, S)))
def test_every_pair_of_states(current, new):
    if (current, new) in ALLOWED:
        assert transition(current, new) is new
    else:
        with pytest.raises(InvalidTransition) as err:
            transition(current, new, "m-1234abcd")
        assert str(err.value) == f"instance m-1234abcd: no transition from {current} to {new}"
        assert isinstance(err.value, PoolError)


def test_states_are_strings_by_name():
    assert S.READY == "READY"
    assert S("SLEEPING") is S.SLEEPING


def test_instance_id_and_url():
    assert new_instance_id("smollm2", "0a1b2c3d") == "smollm2-0a1b2c3d"
    generated = new_instance_id("smollm2")
    assert generated.startswith("smollm2-") and len(generated) == len("smollm2-") + 8
    int(generated.rsplit("-", 1)[1], 16)
    assert generated != new_instance_id("smollm2")

    i = Instance(id="m-1", deployment="m", created_at=10.0, max_concurrency=8)
    with pytest.raises(ValueError, match="m-1 has no port"):
        _ = i.url
    i.port = 41234
    assert (i.id, i.url, i.max_concurrency) == ("m-1", "http://127.0.0.1:41234", 8)  # the Endpoint fields
    assert Instance(id="v6", deployment="m", created_at=0, max_concurrency=1, host="::1", port=9).url == (
        "http://[::1]:9"
    )


def test_seconds_are_closed_out_per_state_on_ticks_and_transitions():
    i = Instance(id="m-1", deployment="m", created_at=100.0, max_concurrency=4)
    assert (i.state, i.state_since, i.restarts) == (S.PENDING, 100.0, 0)
    script = [
        # (now, action, expected (state the seconds belong to, seconds))
        (100.5, S.STARTING, (S.PENDING, 0.5)),
        (103.0, "tick", (S.STARTING, 2.5)),
        (107.0, S.READY, (S.STARTING, 4.0)),
        (117.0, "tick", (S.READY, 10.0)),
        (117.0, "tick", (S.READY, 0.0)),  # a second tick at the same instant adds nothing
        (116.0, "tick", (S.READY, 0.0)),  # nor one that reads an older time
        (127.0, S.DRAINING, (S.READY, 10.0)),
        (130.0, S.STOPPED, (S.DRAINING, 3.0)),
    ]
    total = 0.0
    for now, action, expected in script:
        got = i.accrue(now) if action == "tick" else i.move_to(action, now)
        assert got == expected, (now, action)
        total += got[1]
    assert (i.state, i.state_since) == (S.STOPPED, 130.0)
    assert total == 30.0  # every second from creation to stop, counted once


def test_a_refused_transition_changes_nothing():
    i = Instance(id="m-1", deployment="m", created_at=0.0, max_concurrency=4, state=S.READY)
    with pytest.raises(InvalidTransition, match="m-1: no transition from READY to STOPPED"):
        i.move_to(S.STOPPED, 5.0)
    assert (i.state, i.state_since, i.accounted_at) == (S.READY, 0.0, 0.0)
