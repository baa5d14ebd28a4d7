"""What a batch request and each input line must be (`stoker.batch.lines`)."""

from __future__ import annotations

import io
import json

import pytest

from stoker.batch.config import BatchConfig
from stoker.batch.lines import BadLine, Entry, TooManyLines, batch_request, request_body, scan
from stoker.errors import APIError

CHAT = "/v1/chat/completions"
OK = {"input_file_id": "file-" + "0" * 24, "endpoint": CHAT, "completion_window": "24h"}


def row(custom_id="a", **over) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"model": "m", "messages": []}}
    return json.dumps({**line, **over}).encode() + b"\n"


def test_each_line_is_an_entry_or_a_bad_line_with_its_number():
    data = (
        row("a") + b"\n" + b"not json\n" + row("a") + row("b", method="GET") + row("c", body={"stream": True})
    )
    out = list(scan(io.BytesIO(data), CHAT, 100))
    assert isinstance(out[0], Entry) and out[0].model == "m" and out[0].offset == 0
    assert [(o.line, o.custom_id, o.code) for o in out[1:]] == [
        (3, None, "invalid_request"),
        (4, "a", "duplicate_custom_id"),
        (5, "b", "invalid_request"),
        (6, "c", "invalid_request"),
    ]
    assert all(isinstance(o, BadLine) for o in out[1:])
    assert data[out[0].offset : out[0].offset + out[0].length] == row("a")


def test_the_line_bound_fails_the_file():
    with pytest.raises(TooManyLines):
        list(scan(io.BytesIO(row("a") + row("b") + row("c")), CHAT, 2))


def test_the_sent_body_takes_the_batch_priority():
    body, model = request_body(row("a", body={"model": "m", "priority": -5}), 100)
    assert model == "m" and json.loads(body)["priority"] == 100


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/responses"}, "endpoint"),
        ({"completion_window": "10s"}, "completion_window"),
        ({"completion_window": "30d"}, "completion_window"),
        ({"input_file_id": "../etc"}, "input_file_id"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_bad_request_names_its_field(change, param):
    with pytest.raises(APIError) as caught:
        batch_request({**OK, **change}, BatchConfig())
    assert caught.value.status == 400 and caught.value.param == param


def test_a_good_request():
    asked = batch_request({**OK, "metadata": {"job": "x"}}, BatchConfig())
    assert asked.window_s == 86_400 and asked.metadata == {"job": "x"}
