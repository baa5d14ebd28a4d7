"""Recycling without a dip, end to end: the real `stoker up`, real CPU-engine processes, a client
sending steady load, and a deployment whose instances outlive `--max-instance-age`.

Every answer must be 200, an instance must be replaced (a new instance id serves afterwards), and
the READY count, sampled from the admin API for as long as the load runs, must never fall below
the count the deployment started with. Nothing waits on a timing: the load runs until the
platform reports a recycle (`stoker_instance_recycles_total{outcome="replaced"}`) and a new
instance answered, under a generous deadline."""

from __future__ import annotations

import threading
import time

import httpx

from tests.deadlines import deadline

MAX_AGE = "10s"  # the shortest the platform takes (`warm_pool.recycle.MIN_MAX_AGE_S`)
WITHIN_S = deadline(300)  # generous: two engine starts on a loaded 2-core machine


def test_instances_past_their_age_are_replaced_under_load_without_a_refusal_or_a_dip(
    platform_factory, tiny_model_dir
):
    p = platform_factory("--stable-window", "2")
    deployed = p.deploy(
        "tiny",
        tiny_model_dir,
        "--min-warm",
        "2",
        "--max",
        "2",
        "--idle-timeout",
        "600",
        "--max-instance-age",
        MAX_AGE,
    )
    assert deployed["deployed"]["settings"]["max_instance_age_s"] == 10.0
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 2, WITHIN_S, "two READY instances")
    # READY ones: on a slow machine the first may already be due, its replacement starting (no age yet)
    ready = [i for i in p.deployments()["tiny"]["instance_list"] if i["state"] == "READY"]
    first = {i["id"] for i in ready}
    assert len(first) >= 2 and all(i["age_s"] >= 0 for i in ready)

    stop = threading.Event()
    answers: list[tuple[int, str | None]] = []
    ready_seen: list[int] = []
    errors: list[BaseException] = []

    def load() -> None:
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4}
        with httpx.Client(base_url=p.url, timeout=deadline(120)) as client:
            while not stop.is_set():
                try:
                    r = client.post("/v1/completions", json=body)
                    answers.append((r.status_code, r.headers.get("x-stoker-instance")))
                except httpx.HTTPError as exc:  # counted as a failure below, never ignored
                    errors.append(exc)

    def sample() -> None:
        with httpx.Client(base_url=p.url, timeout=deadline(30)) as client:
            while not stop.is_set():
                data = client.get("/admin/v1/deployments").json()["data"]
                ready_seen.append(next(d for d in data if d["name"] == "tiny")["instances"]["READY"])
                time.sleep(0.05)

    threads = [threading.Thread(target=load) for _ in range(2)] + [threading.Thread(target=sample)]
    for t in threads:
        t.start()
    try:

        def replaced() -> bool:
            newer = {ident for _, ident in answers[-20:] if ident is not None} - first
            return p.metric("stoker_instance_recycles_total", outcome="replaced") >= 1 and bool(newer)

        p.wait_for(replaced, WITHIN_S, "a recycled instance replaced and a new one answering")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=deadline(180))

    assert not errors, errors[:3]
    statuses = {status for status, _ in answers}
    assert statuses == {200}, [a for a in answers if a[0] != 200][:5]
    assert len(ready_seen) > 10 and min(ready_seen) >= 2, ready_seen
    served_by = {ident for _, ident in answers}
    assert served_by - first, "no new instance served"
    assert p.metric("stoker_instance_recycles_total", outcome="called_off") == 0
    ages = [i["age_s"] for i in p.deployments()["tiny"]["instance_list"] if i["state"] == "READY"]
    assert ages and all(a >= 0 for a in ages)


def test_a_max_age_below_the_floor_is_refused_in_one_line(platform_factory, tiny_model_dir):
    p = platform_factory()
    out = p.cli("deploy", "tiny", "--model", str(tiny_model_dir), "--max-instance-age", "5s", check=False)
    assert out.returncode != 0
    message = out.stderr.strip()
    assert "max_instance_age_s" in message and "10s" in message and "\n" not in message
    out = p.cli("deploy", "tiny", "--model", str(tiny_model_dir), "--idle-timeout", "1", check=False)
    assert out.returncode != 0 and "Idle timeout 1s is too short" in out.stderr.strip()
    out = p.cli("up", "--port", "1", "--max-instance-age", "5s", check=False)  # refused before it serves
    assert out.returncode != 0
    assert out.stderr.strip() == "stoker: error: --max-instance-age must be at least 10s, got 5s"
