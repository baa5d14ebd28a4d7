"""A deployed snapshot whose file is truncated: the real `stoker up` refuses its requests with a 503
that names the corrupt snapshot, well before the hold deadline, and does not restart forever."""

from __future__ import annotations

import os
import time

import httpx

from tests.deadlines import deadline


def test_a_truncated_snapshot_file_is_a_clear_503_and_no_restart_loop(platform_factory, tiny_model_dir):
    p = platform_factory("--hold-deadline", "60")
    snapshot_id = p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")["snapshot_id"]
    weights = p.home / "snapshots" / snapshot_id / "model.safetensors"
    weights.chmod(0o644)  # the store makes its files read-only
    os.truncate(weights, 100)

    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    started = time.monotonic()
    r = httpx.post(f"{p.url}/v1/completions", json=body, timeout=deadline(90))
    assert time.monotonic() - started < 30  # not the 60 s hold deadline
    assert r.status_code == 503 and "retry-after" in r.headers
    error = r.json()["error"]
    assert error["code"] == "deployment_unavailable"
    assert f"snapshot {snapshot_id[:12]} is corrupt" in error["message"]
    assert "model.safetensors" in error["message"]

    # More requests are refused at once, and nothing more is started (the backoff would have
    # retried after 1 s, 2 s, 4 s ... and each retry failed the same way).
    for _ in range(3):
        again = httpx.post(f"{p.url}/v1/completions", json=body, timeout=deadline(90))
        assert again.status_code == 503 and again.json()["error"]["code"] == "deployment_unavailable"
    time.sleep(3)
    assert p.metric("stoker_instance_starts_total", deployment="tiny", outcome="failed") == 1
    assert p.metric("stoker_instance_starts_total", deployment="tiny", outcome="ready") == 0
    assert p.engine_pids() == {}  # no engine process was spawned to crash on it

    # `stoker ls` shows the reason too.
    assert f"  unavailable: snapshot {snapshot_id[:12]} is corrupt" in p.cli("ls").stdout
    assert "model.safetensors" in p.deployments()["tiny"]["unavailable"]

    verify = p.cli("snapshot", "verify", snapshot_id[:12], check=False)
    assert verify.returncode == 1 and "model.safetensors" in verify.stdout + verify.stderr
