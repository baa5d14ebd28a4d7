"""A stopped engine (SIGSTOP: it takes connections and answers nothing) leaves routing within
seconds, requests meanwhile go to the other instance, and it comes back after SIGCONT and a probe.
Every interval comes from `stoker up`'s flags; nothing depends on how fast an engine starts."""

from __future__ import annotations

import os
import signal
import time

import httpx

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}


def stream(p) -> tuple[str, float]:
    """One streamed completion, read to its end: the instance that served it, and the seconds it took."""
    began = time.monotonic()
    with httpx.stream("POST", f"{p.url}/v1/completions", json=BODY, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
    return r.headers["x-stoker-instance"], time.monotonic() - began


def test_a_stopped_instance_leaves_routing_and_comes_back(platform_factory, tiny_model_dir):
    p = platform_factory(
        "--stream-headers-timeout", "2",
        "--eject-after", "2",
        "--eject-time", "1",
        "--health-interval", "0.5",
        "--health-timeout", "0.5",
    )  # fmt: skip
    p.deploy("tiny", tiny_model_dir, "--min-warm", "2", "--max", "2", "--idle-timeout", "600")
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 2, 120, "two READY instances")
    pids = p.engine_pids()
    assert len(pids) == 2
    sick, well = sorted(pids)
    os.kill(pids[sick], signal.SIGSTOP)
    try:
        served = [stream(p) for _ in range(8)]
        # Each within one headers deadline (2 s) and a retry, far below the 300 s of before.
        assert all(seconds < 20 for _, seconds in served), served
        assert all(instance == well for instance, _ in served), served  # retried, or never sent there
        # Probes every 0.5 s: two failed ones eject it within seconds, whatever the requests did.
        p.wait_for(lambda: "ejected from routing" in p.log.read_text(), 30, "the ejection")
        assert [stream(p)[0] for _ in range(4)] == [well] * 4
    finally:
        os.kill(pids[sick], signal.SIGCONT)
    # Back after a probe once the ejection (1 s, 2 s, 4 s … while it stayed stopped) is over.
    p.wait_for(lambda: "back in routing" in p.log.read_text(), 120, "the re-admission")
    assert sick in {stream(p)[0] for _ in range(6)}
    assert set(p.engine_pids()) == {sick, well}  # neither was replaced: a stopped engine is not a dead one
