"""A held plain request through a proxy that closes idle connections, as load balancers do at
their idle timeout: with `stoker up --plain-keepalive`, the 200 goes out at once and a space every
interval, so the request held at zero while the engine starts survives the proxy and the official
openai client parses the answer (JSON skips the leading whitespace). The relay is real TCP on
loopback, in this process: it closes both sides once nothing crossed either way for `IDLE_S`."""

from __future__ import annotations

import openai
import pytest

from tests.deadlines import COLD_ANSWER
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.platform.relays import IdleRelay

IDLE_S = 1.0  # the relay's idle timeout; the keep-alive interval is a fifth of it


@pytest.fixture
def platform(tmp_path, tiny_model_dir):
    args = ("--plain-keepalive", f"{IDLE_S / 5:g}s")
    p = PlatformProcess(tmp_path / "home", free_port(), args).start()
    p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
    yield p
    p.stop()


def test_a_plain_request_held_at_zero_survives_a_proxy_idle_timeout(platform):
    with IdleRelay(platform.port, IDLE_S) as relay:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{relay.port}/v1", api_key="-", max_retries=0, timeout=COLD_ANSWER
        )
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
        assert raw.headers["x-stoker-held"] == "whitespace" and raw.headers["x-stoker-cold-start"] == "true"
        answer = raw.parse()
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1
        assert relay.cut == 0
        # READY now: the next one is not held, and has its own headers and status.
        warm = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
        assert "x-stoker-held" not in warm.headers and warm.headers["x-stoker-cold-start"] == "false"
