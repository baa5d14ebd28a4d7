"""Bad input never breaks an instance: the JSON bounds of the shared parser (a table), each hostile
body against a real engine on one connection, and what the engine does if its generation loop dies."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from stoker.engine.core import Engine, EngineConfig
from stoker.engine.metrics import EngineMetrics
from stoker.engine.protocol import parse_request
from stoker.errors import APIError
from stoker.http import MAX_JSON_DEPTH, parse_json_object
from tests.platform.engine.conftest import OneConnection


def nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return f'{{"x": {open_ * (depth - 1)}{close * (depth - 1)}}}'.encode()


def deep_objects(depth: int) -> bytes:
    return ('{"a": ' * depth + "1" + "}" * depth).encode()


OK = None
PARSE = [
    # (body, None when it parses, else the 400's param and a fragment of its message)
    (nested(MAX_JSON_DEPTH), OK),
    (nested(MAX_JSON_DEPTH + 1), (None, "deeper than 64")),
    (nested(100_000), (None, "deeper than 64")),
    (deep_objects(MAX_JSON_DEPTH), OK),
    (deep_objects(MAX_JSON_DEPTH + 1), (None, "deeper than 64")),
    (b'{"a": "' + b"[" * 100_000 + b'"}', OK),  # brackets in a string are text
    (b'{"a": "\\"' + b"{" * 1000 + b'"}', OK),  # behind an escaped quote too
    (b'{"a": "\\\\"' + b", " + b"[" * 70 + b"]" * 70 + b"}", (None, "deeper than 64")),  # "\\" ends
    (b'{"a": ' + b"[" * 70 + b"}", (None, "deeper than 64")),  # unbalanced and deep
    (b'{"a": [}', (None, "not valid JSON")),  # unbalanced: the parser says so
    (b'{"a": "' + b'\\"' * 10_000, (None, "not valid JSON")),  # unterminated, no quadratic scan
    (b'{"n": ' + b"1" * 5000 + b"}", (None, "not valid JSON")),  # Python's 4300-digit limit
    (b'{"t": NaN}', (None, "NaN")),
    (b'{"t": -Infinity}', (None, "Infinity")),
    (b'{"a": "\xff"}', (None, "not valid UTF-8")),
    (b'{"a": "\xed\xa0\x80"}', (None, "not valid UTF-8")),  # a surrogate encoded as UTF-8 bytes
    (b"[1, 2]", (None, "must be a JSON object")),
    (b'{"prompt": "\\ud800"}', ("prompt", "lone UTF-16 surrogate")),
    (b'{"messages": [{"content": "ok"}, {"content": "a\\udfffb"}]}', ("messages[1].content", "surrogate")),
    (b'{"stop": ["x", "\\udc00"]}', ("stop[1]", "surrogate")),
    (b'{"a": {"\\ud800": 1}}', ("a", "A key in a")),
    (b'{"p": "\\ud83d\\ude00"}', OK),  # a pair is one character
    (b'{"p": "\\\\ud800"}', OK),  # an escaped backslash: the text \ud800, no surrogate
]


@pytest.mark.parametrize(("raw", "refusal"), PARSE, ids=range(len(PARSE)))
def test_parse_json_object_bounds(raw, refusal):
    if refusal is OK:
        assert isinstance(parse_json_object(raw), dict)
        return
    with pytest.raises(APIError) as info:
        parse_json_object(raw)
    param, fragment = refusal
    assert info.value.status == 400
    assert (info.value.param, fragment in info.value.message) == (param, True), info.value.message
    json.dumps(info.value.body()).encode()  # the answer itself always encodes


GOOD = {"model": "tiny", "prompt": "x", "max_tokens": 2}
HOSTILE = [
    ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [[]]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"model": "tiny\ud800", "prompt": "x"}, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]}, None),
    ("/v1/completions", nested(100_000), None),
]


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_body_is_a_400_and_the_connection_serves_on(engine, path, body, param):
    conn = OneConnection(engine.url)
    try:
        status, _, answer = conn.post(path, body)
        assert status == 400, answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["type"] == "invalid_request_error"
        if path.endswith("chat/completions"):
            param = "messages[0].content"
        assert answer["error"]["param"] == param
        status, _, answer = conn.post("/v1/completions", GOOD)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        conn.close()
    assert httpx.get(f"{engine.url}/health").status_code == 200


def idle_engine(tmp_path: Path) -> Engine:
    """An engine that loaded nothing: enough for what it decides before generating."""
    config = EngineConfig(snapshot_dir=tmp_path, served_model_name="tiny")
    return Engine(config, EngineMetrics("tiny"))


class BlankTemplate:
    """A tokenizer whose chat template renders to nothing."""

    def apply_chat_template(self, *args, **kwargs) -> list[int]:
        return []

    def __len__(self) -> int:
        return 10


def test_a_chat_that_renders_to_no_tokens_is_a_400(tmp_path):
    engine = idle_engine(tmp_path)
    engine._tokenizer = BlankTemplate()
    req = parse_request("chat", {"model": "tiny", "messages": [{"role": "user", "content": ""}]})
    with pytest.raises(APIError) as info:
        engine.prompt_ids(req)
    assert (info.value.status, info.value.param) == (400, "messages")


def test_a_dead_generation_loop_fails_the_engine(tmp_path):
    engine = idle_engine(tmp_path)
    engine.state, engine._manager = "ready", SimpleNamespace(is_running=lambda: True)
    engine.check_serving()
    engine._manager = SimpleNamespace(is_running=lambda: False)  # transformers' thread died
    with pytest.raises(APIError) as info:
        engine.check_serving()
    assert (info.value.status, info.value.code) == (503, "engine_failed")
    assert (engine.state, engine.failure) == ("failed", "the generation loop stopped")
