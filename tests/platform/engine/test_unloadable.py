"""`stoker engine` on a snapshot whose load fails on the loading thread (after the HTTP server is
up): exit 1 and a one-line `stoker: error:`, no traceback. It used to exit 0: the engine's shutdown
overwrote the "failed" state the exit status was read from."""

from __future__ import annotations

import json
import shutil
import subprocess

from tests.conftest import STOKER
from tests.deadlines import deadline
from tests.platform.engine.conftest import free_port


def test_a_load_that_fails_exits_1_in_one_line(tmp_path, tiny_model_dir, stoker_env) -> None:
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights say 128: transformers refuses the load
    (src / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [STOKER, "engine", "--snapshot", str(src), "--port", str(free_port()), "--log-level", "warning"],
        env=stoker_env,
        capture_output=True,
        text=True,
        timeout=deadline(300),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("stoker: error: ")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1]
    assert f"cannot load {src}" in errors[0]
