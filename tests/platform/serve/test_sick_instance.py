"""A stopped engine (SIGSTOP: it takes connections and answers nothing) leaves routing within
seconds, requests meanwhile go to the other instance, and it comes back after SIGCONT and a probe.
Every interval comes from `stoker up`'s flags; nothing depends on how fast an engine starts."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.deadlines import ENGINE_START, HTTP_READ, WAIT, deadline, flag
from tests.platform.conftest import pid_alive

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}


def stream(p) -> tuple[str, float]:
    """One streamed completion, read to its end: the instance that served it, and the seconds it took."""
    began = time.monotonic()
    with httpx.stream("POST", f"{p.url}/v1/completions", json=BODY, timeout=HTTP_READ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
    return r.headers["x-stoker-instance"], time.monotonic() - began


def test_a_stopped_instance_leaves_routing_and_comes_back(platform_factory, tiny_model_dir):
    p = platform_factory(
        "--stream-headers-timeout", "2",
        "--eject-after", "2",
        "--eject-time", "1",
        "--replace-after-ejections", "1000",  # here a stopped engine is waited for, not replaced
        "--health-interval", "0.5",
        "--health-timeout", "0.5",
    )  # fmt: skip
    p.deploy("tiny", tiny_model_dir, "--min-warm", "2", "--max", "2", "--idle-timeout", "600")
    p.wait_for(
        lambda: p.deployments()["tiny"]["instances"]["READY"] == 2, ENGINE_START, "two READY instances"
    )
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
        p.wait_for(lambda: "ejected from routing" in p.log.read_text(), deadline(30), "the ejection")
        assert [stream(p)[0] for _ in range(4)] == [well] * 4
    finally:
        os.kill(pids[sick], signal.SIGCONT)
    # Back after a probe once the ejection (1 s, 2 s, 4 s … while it stayed stopped) is over.
    p.wait_for(lambda: "back in routing" in p.log.read_text(), deadline(120), "the re-admission")
    assert sick in {stream(p)[0] for _ in range(6)}
    assert set(p.engine_pids()) == {sick, well}  # neither was replaced: a stopped engine is not a dead one


def test_a_lone_instance_stopped_for_good_is_replaced_and_the_held_request_answered(
    platform_factory, tiny_model_dir
):
    p = platform_factory(
        "--stream-headers-timeout", "1",
        "--eject-after", "1",
        "--eject-time", "0.5",
        "--replace-after-ejections", "3",
        "--health-interval", "0.3",
        "--health-timeout", "0.3",
        "--hold-deadline", flag(300),
    )  # fmt: skip
    p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--max", "1", "--idle-timeout", "600")
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, ENGINE_START, "a READY instance")
    (stopped,) = p.engine_pids().values()
    os.kill(stopped, signal.SIGSTOP)
    try:
        # Its only instance is ejected, again and again, then replaced: the request waits for that.
        # Held after its first try timed out: a 200 with keep-alives, then the replacement's answer.
        with httpx.stream("POST", f"{p.url}/v1/completions", json=BODY, timeout=deadline(300)) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
        assert [pid for pid in p.engine_pids().values() if pid != stopped]  # a replacement served it
        assert "ejected 3 times in a row" in p.log.read_text()
        assert p.metric("stoker_instance_ejections_total", deployment="tiny") >= 3
    finally:
        os.kill(stopped, signal.SIGCONT)
    p.wait_for(lambda: not pid_alive(stopped), WAIT, "the stopped engine gone")
