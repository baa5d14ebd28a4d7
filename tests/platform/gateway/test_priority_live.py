"""Priority classes end to end: a real `stoker up`, keys made with the CLI with a default priority
and a floor, plain HTTP. The queue is shown full with the engine stopped (SIGSTOP), so what it holds
stays held until the test says: nothing here races a clock.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import pytest

from tests.deadlines import ENGINE_START, WAIT, deadline
from tests.platform.gateway.test_keys import ADMIN
from tests.platform.gateway.test_rate_limits import BODY, key, post


@pytest.fixture
def platform(platform_factory, tiny_model_dir):
    p = platform_factory(
        "--health-interval", "600",  # no probe may eject the engine the test stops
        "--max-queued", "3",
        env={"STOKER_ADMIN_KEY": ADMIN},
    )  # fmt: skip
    p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--max", "1", "--idle-timeout", "600")
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, ENGINE_START, "a READY instance")
    return p


def queued(p) -> float:
    return p.metric("stoker_queue_length", deployment="tiny")


def test_a_bulk_keys_class_gives_way_to_an_interactive_key_and_its_floor_holds(platform):
    p = platform
    bulk = key(p, "--priority", "10", "--priority-min", "10")
    app = key(p)  # the default class, 0
    listed = json.loads(p.cli("keys", "ls", "--json").stdout)
    assert [(k["priority"], k["priority_min"]) for k in listed] == [(10, 10), (None, None)]
    assert "10 priority, 10 priority-min" in p.cli("keys", "ls").stdout

    # A bulk key may not ask to go ahead of its class: a 400 naming the field, before any hold.
    jump = post(p, bulk, {**BODY, "priority": 0})
    assert jump.status_code == 400 and jump.json()["error"]["param"] == "priority"
    assert "floor of 10" in jump.json()["error"]["message"]
    bad = post(p, app, {**BODY, "priority": 5000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert post(p, bulk, {**BODY, "priority": 20}).status_code == 200  # later is always allowed
    assert post(p, bulk).status_code == 200  # its default reaches the engine, which takes it

    (pid,) = p.engine_pids().values()
    os.kill(pid, signal.SIGSTOP)
    pool = concurrent.futures.ThreadPoolExecutor(16)
    try:
        # The admin fills the instance's 8 slots and one more waits: from here on, anything held stays held.
        admin = [pool.submit(post, p, ADMIN) for _ in range(9)]
        p.wait_for(lambda: queued(p) == 1, WAIT, "a held request")
        held = [pool.submit(post, p, bulk)]
        p.wait_for(lambda: queued(p) == 2, WAIT, "a bulk request held")
        held.append(pool.submit(post, p, bulk))
        p.wait_for(lambda: queued(p) == 3, WAIT, "the queue full")
        refused = post(p, bulk)  # its own next one: refused at once, as always
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        urgent = pool.submit(post, p, app)  # the bulk class's newest request gives way to it
        displaced = held[1].result(timeout=deadline(60))
        assert displaced.status_code == 503 and displaced.json()["error"]["code"] == "queue_full"
        p.wait_for(lambda: queued(p) == 3, WAIT, "the interactive request held")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [f.result(timeout=deadline(300)).status_code for f in admin] == [200] * 9
    assert urgent.result(timeout=deadline(300)).status_code == 200
    assert held[0].result(timeout=deadline(300)).status_code == 200
    pool.shutdown()
