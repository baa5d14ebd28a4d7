"""The request log's parts without a platform: the file (append, rotation, no links), the text and
usage read from answers, the tap on a scripted ASGI exchange. The live side is in
`test_request_log_live.py`."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from types import SimpleNamespace

import pytest

from stoker.gateway.request_log import (
    LOG_FILE,
    Observer,
    RequestLogFile,
    answer_text,
    masked_prompt,
    prompt_chars,
)
from tests.deadlines import deadline


def test_the_file_rotates_by_size_and_keeps_a_bounded_number(tmp_path):
    log = RequestLogFile(tmp_path / "rl", max_bytes=4096, keep=2)
    for i in range(200):
        log.write({"i": i, "pad": "x" * 100})
    log.close()
    names = sorted(p.name for p in (tmp_path / "rl").iterdir())
    assert names == [LOG_FILE, f"{LOG_FILE}.1", f"{LOG_FILE}.2"]
    for p in (tmp_path / "rl").iterdir():
        assert p.stat().st_size <= 4096 and stat.S_IMODE(p.stat().st_mode) == 0o600
    last = [json.loads(line)["i"] for line in (tmp_path / "rl" / LOG_FILE).read_text().splitlines()]
    assert last[-1] == 199 and last == list(range(last[0], 200))  # whole lines, in order


def test_the_file_is_not_opened_through_a_link(tmp_path):
    (tmp_path / "rl").mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, tmp_path / "rl" / LOG_FILE)
    with pytest.raises(OSError):
        RequestLogFile(tmp_path / "rl").write({"a": 1})
    assert target.read_text() == ""


@pytest.mark.parametrize(("max_bytes", "keep"), [(100, 4), (1 << 20, 0), (1 << 20, 101)])
def test_bad_file_settings(tmp_path, max_bytes, keep):
    with pytest.raises(ValueError):
        RequestLogFile(tmp_path, max_bytes, keep)


def test_answer_text_from_a_completion_and_from_events():
    completion = (
        b'{"choices":[{"message":{"role":"assistant","content":"Hi \\"you\\"\\n"},"finish_reason":"stop"}]}'
    )
    assert answer_text(completion) == 'Hi "you"\n'
    events = b'data: {"choices":[{"delta":{"content":"I\'m"}}]}\n\ndata: {"choices":[{"delta":{"content":" sorry"}}]}\n\n'
    assert answer_text(events) == "I'm sorry"
    assert answer_text(b'{"choices":[{"text":"abc","logprobs":{"content":[1]}}]}') == "abc"
    assert answer_text(b'{"choices":[{"message":{"content":"cut off her') == ""


def test_prompts_are_measured_and_masked():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "my key is sk-abcdefghijklmnop"}]},
    ]
    assert prompt_chars(messages) == len("be brief") + len("my key is sk-abcdefghijklmnop")
    assert prompt_chars("four") == 4 and prompt_chars(None) == 0
    masked = masked_prompt(messages)
    assert "sk-abcdefghijklmnop" not in json.dumps(masked) and "[redacted]" in masked[1]["content"]
    assert masked_prompt("password=hunter22 please") == "password=[redacted] please"


def _exchange(observer: Observer, deployment, parsed: dict, messages: list[dict]) -> dict:
    """Send `messages` through a tap as the gateway would; the record written."""
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def run():
        tap = observer.tap(send, "chat", deployment, "key-1", parsed, parsed.get("stream", False))
        assert tap is not None
        for m in messages:
            await tap(m)
        observer.done(tap, {"stoker.revision": 3})

    asyncio.run(run())
    assert sent == messages  # passed through untouched
    return json.loads(observer.file.path.read_text().splitlines()[-1])


def test_a_stream_is_recorded_with_usage_revision_and_cold_start(tmp_path):
    observer = Observer(RequestLogFile(tmp_path), log_all=True)
    head = {"type": "http.response.start", "status": 200, "headers": [(b"x-stoker-revision", b"2"), (b"x-stoker-cold-start", b"true")]}  # fmt: skip
    body = [
        b"\n\n",  # a keep-alive while held: not the first byte
        b'data: {"choices":[{"delta":{"content":"Hello"},"finish_reason":null}]}\n\n',
        b'data: {"choices":[{"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n',
        b"data: [DONE]\n\n",
    ]
    messages = [head, *({"type": "http.response.body", "body": b, "more_body": True} for b in body)]
    parsed = {
        "model": "chat",
        "stream": True,
        "messages": [{"role": "user", "content": "secret sk-abcdefghijkl"}],
    }
    record = _exchange(observer, SimpleNamespace(spec=SimpleNamespace()), parsed, messages)
    assert record["revision"] == 2 and record["cold_start"] is True and record["key_id"] == "key-1"
    assert (record["prompt_tokens"], record["completion_tokens"], record["finish_reason"]) == (7, 2, "length")
    assert record["status"] == 200 and record["stream"] is True and record["prompt_chars"] == 22
    assert 0 <= record["ttft_s"] <= record["e2e_s"]
    assert "prompt" not in record and "answer" not in record and "sk-" not in json.dumps(record)


def test_content_is_logged_only_when_the_deployment_asks_and_masked(tmp_path):
    observer = Observer(RequestLogFile(tmp_path))
    parsed = {"model": "chat", "messages": [{"role": "user", "content": "token: abcdefgh1234"}]}
    answer = b'{"choices":[{"message":{"content":"I\'m sorry, but Bearer abcdefghijklmn is not mine"},"finish_reason":"stop"}]}'
    messages = [
        {"type": "http.response.start", "status": 200, "headers": []},
        {"type": "http.response.body", "body": answer, "more_body": False},
    ]
    quiet = SimpleNamespace(spec=SimpleNamespace(log_requests=False, log_content=False))
    assert observer.tap(None, "chat", quiet, "k", parsed, False) is None  # nobody asked: no tap at all
    loud = SimpleNamespace(spec=SimpleNamespace(log_requests=False, log_content=True))
    record = _exchange(observer, loud, parsed, messages)
    assert record["revision"] == 3  # from the scope: no header
    assert record["refusal"] is True and record["completion_tokens"] is None
    assert record["prompt"] == [{"role": "user", "content": "token: [redacted]"}]
    assert record["answer"] == "I'm sorry, but Bearer [redacted] is not mine"


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (
            ["--request-log-files", "0"],
            "--request-log-size/--request-log-files: the request log keeps 1..100 old files",
        ),
        (["--request-log-size", "1KiB"], "must be 4096 bytes or more"),
        (["--request-log-size", "lots"], "--request-log-size: 'lots' is not a size"),
        (
            ["--drift-window", "500ms"],
            "--drift-window/--drift-min-requests: the drift window must be 1 s..7 d",
        ),
        (["--drift-min-requests", "0"], "drift needs 1..1000000 answers a window"),
        (["--drift-window", "soon"], "argument --drift-window: 'soon' is not a duration"),
    ],
)
def test_bad_up_flags_are_one_line(tmp_path, flags, fragment):
    import subprocess

    from tests.conftest import STOKER
    from tests.snapshots.support import assert_one_line_error

    env = {**os.environ, "STOKER_HOME": str(tmp_path)}
    env.pop("STOKER_ADMIN_KEY", None)
    proc = subprocess.run(
        [STOKER, "up", "--port", "1", *flags], capture_output=True, text=True, timeout=deadline(120), env=env
    )
    assert_one_line_error(proc, fragment)
