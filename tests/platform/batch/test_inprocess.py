"""A batch line sent in process (`stoker.batch.inprocess.call`) through a real activator (the
activator tests' rig: real upstream servers on loopback, a minimal gateway in front): its status
is always the answer's own, even where held plain requests are kept alive with whitespace, since
the status decides whether the line lands in the output file or the error file."""

from __future__ import annotations

import asyncio
import json

from stoker.batch.inprocess import call
from stoker.spec.keys import ADMIN
from tests.activator.conftest import COMPLETION, Ep, MemorySource, Rig, eventually, rig  # noqa: F401

BODY = json.dumps({"model": "m", "prompt": "hi"}).encode()


async def test_a_line_refused_while_held_keeps_its_503_under_plain_keepalive(rig: Rig) -> None:  # noqa: F811
    rig.activator(MemorySource(), plain_keepalive_interval_s=0.05, hold_deadline_s=0.3)
    status, headers, answer = await call(rig.front, "/v1/completions", BODY, ADMIN, "batch_x")
    assert status == 503 and "x-stoker-held" not in headers  # a client's would be a 200 with spaces
    assert answer["error"]["code"] == "hold_deadline"


async def test_a_held_line_is_answered_with_the_instances_own_answer(rig: Rig) -> None:  # noqa: F811
    source = MemorySource()
    activator = rig.activator(source, plain_keepalive_interval_s=0.05, hold_deadline_s=30)
    line = asyncio.ensure_future(call(rig.front, "/v1/completions", BODY, ADMIN, "batch_x"))
    await eventually(lambda: activator.load().queued == 1)
    source.eps.append(Ep("a", rig.a_url))
    activator.capacity_changed()
    status, headers, answer = await line
    assert (status, answer) == (200, COMPLETION) and headers["x-stoker-instance"] == "a"
