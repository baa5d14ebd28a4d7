"""`priority.forwarded`: the body an instance gets says the request's priority to an engine that
takes it and none to one that does not; every other body goes through as it came (a table)."""

from __future__ import annotations

import json

import pytest

from activator.priority import forwarded

PLAIN = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("body", "priority", "takes", "sent"),
    [
        (PLAIN, 0, True, None),  # nothing to say: untouched
        (PLAIN, 0, False, None),
        ({**PLAIN, "priority": 5}, 5, True, None),  # the body says it already
        ({**PLAIN, "priority": 0}, 0, False, None),  # vLLM takes 0 under fcfs too
        (PLAIN, 7, True, {**PLAIN, "priority": 7}),  # the key's default, added
        ({**PLAIN, "priority": 5}, 5, False, PLAIN),  # vLLM under fcfs would refuse it: removed
        (PLAIN, 7, False, None),  # the key's default stays in the hold queue
    ],
)
def test_the_body_says_the_priority_its_engine_takes(body, priority, takes, sent) -> None:
    raw = json.dumps(body).encode()
    for parsed in (body, None):  # the gateway's parse, or none (parsed here when needed)
        out = forwarded(raw, parsed, priority, takes)
        if sent is None:
            assert out is raw
        else:
            assert json.loads(out) == sent


def test_a_body_that_is_no_json_object_goes_as_it_came() -> None:
    for raw in (b"not json", b"[1, 2]", b'"priority"'):
        assert forwarded(raw, None, 3, True) is raw
