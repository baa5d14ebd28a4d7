"""Sleep and wake, admission limits, client disconnects and SIGTERM, on real engine processes."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from tests.deadlines import HTTP_READ, deadline

GREEDY = {"model": "tiny", "prompt": "The capital of France", "max_tokens": 12, "temperature": 0}


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=HTTP_READ).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.split()[-1])
    return 0.0


def stream_lines(url: str, body: dict, timeout: float = HTTP_READ):
    """Open a streaming completion; returns (client, response) for the caller to read and close."""
    client = httpx.Client(timeout=timeout)
    request = client.build_request("POST", f"{url}/v1/completions", json={**body, "stream": True})
    return client, client.send(request, stream=True)


def test_sleep_refuses_then_wake_serves_the_same_weights(fresh_engine):
    e = fresh_engine()
    before = httpx.post(f"{e.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    assert httpx.get(f"{e.url}/is_sleeping").json() == {"is_sleeping": False}

    assert httpx.post(f"{e.url}/sleep?level=1").status_code == 200
    assert httpx.get(f"{e.url}/is_sleeping").json() == {"is_sleeping": True}
    # Healthy while asleep, as vLLM is: a probe must not have the instance replaced for resting.
    assert httpx.get(f"{e.url}/health").status_code == 200
    r = httpx.post(f"{e.url}/v1/completions", json=GREEDY)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "engine_asleep"
    assert r.headers["retry-after"]
    assert metric(e.url, "stoker_engine_sleeping") == 1

    assert httpx.post(f"{e.url}/wake_up").status_code == 200
    assert httpx.get(f"{e.url}/health").status_code == 200
    after = httpx.post(f"{e.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    assert after == before  # the weights came back bit for bit
    assert metric(e.url, "stoker_engine_startup_phase_seconds", phase="wake_up") > 0

    # level 2 also drops the snapshot from the page cache; waking still restores the same model
    assert httpx.post(f"{e.url}/sleep?level=2").status_code == 200
    assert httpx.post(f"{e.url}/wake_up").status_code == 200
    assert httpx.post(f"{e.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"] == before
    assert httpx.post(f"{e.url}/sleep?level=3").status_code == 400


def test_full_queue_answers_503_with_retry_after(fresh_engine):
    e = fresh_engine("--max-num-seqs", "1", "--max-waiting", "0")
    client, long = stream_lines(
        e.url, {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True}
    )
    try:
        assert long.status_code == 200
        lines = long.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # generating now
        r = httpx.post(f"{e.url}/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
        assert metric(e.url, "stoker_engine_rejected_requests_total", reason="queue_full") == 1
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
    finally:
        long.close()
        client.close()
    assert (
        httpx.post(
            f"{e.url}/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2}
        ).status_code
        == 200
    )


def test_waiting_request_is_served_when_a_slot_frees(fresh_engine):
    e = fresh_engine("--max-num-seqs", "1", "--max-waiting", "4")
    results = []

    def call():
        results.append(
            httpx.post(f"{e.url}/v1/completions", json={**GREEDY, "max_tokens": 30}, timeout=HTTP_READ)
        )

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200, 200]


def test_client_disconnect_cancels_generation(engine):
    aborted = metric(engine.url, "vllm:request_success_total", finished_reason="abort")
    client, resp = stream_lines(
        engine.url, {"model": "tiny", "prompt": "x", "max_tokens": 2000, "ignore_eos": True}
    )
    lines = resp.iter_lines()
    next(line for line in lines if line.startswith("data:"))
    resp.close()
    client.close()
    end = time.monotonic() + deadline(10)
    while time.monotonic() < end:
        if metric(engine.url, "vllm:request_success_total", finished_reason="abort") > aborted:
            break
        time.sleep(0.05)
    assert metric(engine.url, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(engine.url, "vllm:num_requests_running") == 0
    generated = metric(engine.url, "vllm:generation_tokens_total")
    time.sleep(0.5)
    assert metric(engine.url, "vllm:generation_tokens_total") == generated  # nothing generates any more


def test_sigterm_lets_the_stream_in_flight_finish(fresh_engine):
    e = fresh_engine("--grace-period", "60")
    client, resp = stream_lines(
        e.url, {"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True}
    )
    lines = resp.iter_lines()
    first = next(line for line in lines if line.startswith("data:"))
    e.proc.send_signal(signal.SIGTERM)
    rest = [line for line in lines if line.startswith("data:")]
    resp.close()
    client.close()
    events = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]"
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert e.proc.wait(timeout=deadline(30)) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{e.url}/health", timeout=2)


def test_engine_refuses_a_snapshot_with_pickled_weights(tmp_path, tiny_model_dir, stoker_env):
    import shutil
    import subprocess

    from tests.conftest import STOKER

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    r = subprocess.run(
        [STOKER, "engine", "--snapshot", str(bad), "--port", "1"],
        capture_output=True,
        text=True,
        env=stoker_env,
    )
    assert r.returncode == 1
    assert re.search(r"unpickling runs code", r.stderr)
    assert "Traceback" not in r.stderr
