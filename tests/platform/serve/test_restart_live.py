"""What `stoker up` learned survives a restart, live: a real platform on a data dir serves the tiny
model, is stopped with SIGTERM and started again on the same data dir, and `stoker cost --json`,
the dashboard's history (`GET /admin/v1/history`) and the arrival log still count what was served
before; the pool carries on with its policy's learned state; and what comes after adds to it.
Nothing here depends on how long anything took: every wait is for a state, within a bound."""

from __future__ import annotations

import json
import re
import stat
import subprocess

import httpx
import psutil

from tests.conftest import STOKER
from tests.deadlines import CLI, COLD_ANSWER, ENGINE_START
from tests.platform.conftest import pid_alive
from tests.platform.engine.conftest import free_port
from tests.snapshots.support import assert_one_line_error

ARGS = ("--stable-window", "2", "--checkpoint-interval", "1s")
ENV = {"STOKER_HISTORY_INTERVAL": "0.5"}  # a point every half second: the answers show soon


def _chat(url: str, n: int) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": n}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=COLD_ANSWER)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _answered(history: dict) -> float:
    """The answers the dashboard's hour counts for tiny: rate × seconds, point by point."""
    return sum(
        p["deployments"].get("tiny", {}).get("requests_per_s", 0.0) * p["dt"] for p in history["points"]
    )


def test_cost_history_and_learned_state_survive_a_restart_on_the_same_data_dir(
    platform_factory, tiny_model_dir, tmp_path
):
    home = tmp_path / "home"
    p = platform_factory(*ARGS, home=home, env=ENV)
    p.deploy("tiny", tiny_model_dir, "--max", "1", "--idle-timeout", "600")
    usage = [_chat(p.url, n) for n in (3, 4, 5)]
    tokens_in = sum(u["prompt_tokens"] for u in usage)
    tokens_out = sum(u["completion_tokens"] for u in usage)
    p.wait_for(
        lambda: round(_answered(p.admin_get("/admin/v1/history"))) == 3, what="3 answers in the history"
    )
    # READY seconds are accrued at the pool's next tick (each second), maybe after the answers
    p.wait_for(lambda: _ready_seconds(p) > 0, what="READY seconds in the cost")
    [before] = json.loads(p.cli("cost", "--json").stdout)
    assert (before["requests"], before["tokens_in"], before["tokens_out"]) == (3, tokens_in, tokens_out)
    assert p.stop() == 0  # SIGTERM: drained, then the shutdown's checkpoint

    checkpoints = home / "checkpoints"
    assert sorted(f.name for f in checkpoints.iterdir()) == ["cost.json", "history.json", "policies.json"]
    for f in checkpoints.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    [saved] = json.loads((checkpoints / "policies.json").read_text())["body"]["pools"]
    assert (saved["pool"], saved["policy"]) == ("tiny@1", "predictive")

    q = platform_factory(*ARGS, home=home, env=ENV)
    [after] = json.loads(q.cli("cost", "--json").stdout)
    assert (after["requests"], after["tokens_in"], after["tokens_out"]) == (3, tokens_in, tokens_out)
    assert after["cost_usd"] >= before["cost_usd"] > 0  # and the drain's seconds, counted at the end
    assert after["instance_seconds"]["READY"] >= before["instance_seconds"]["READY"] > 0
    assert round(_answered(q.admin_get("/admin/v1/history"))) == 3
    log = q.log_tail(100_000)
    assert f"restored cost from {checkpoints / 'cost.json'}" in log
    assert "pool tiny@1: carries on with its predictive policy's learned state" in log
    assert not re.search(r"checkpoint \S+ refused", log)

    # It counts on from there: one more answer adds to what came back.
    more = _chat(q.url, 2)
    [again] = json.loads(q.cli("cost", "--json").stdout)
    assert (again["requests"], again["tokens_out"]) == (4, tokens_out + more["completion_tokens"])
    # The arrival log was a file all along: the four, the first three from before the restart.
    lines = [json.loads(x) for x in (home / "arrivals" / "arrivals.jsonl").read_text().splitlines()]
    assert [x["deployment"] for x in lines] == ["tiny"] * 4
    assert [x["out"] for x in lines] == [u["completion_tokens"] for u in usage] + [more["completion_tokens"]]


def _ready_seconds(p) -> float:
    [row] = json.loads(p.cli("cost", "--json").stdout)
    return row["instance_seconds"].get("READY", 0.0)


def test_a_second_platform_on_a_data_dir_in_use_is_refused_and_harms_nothing(
    platform_factory, tiny_model_dir
):
    # Before the lock, the second one started silently, killed the first one's warm runtime,
    # took over its running engine and killed it on exit.
    first = platform_factory("--warm-runtimes", "1")
    first.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--max", "1")
    first.wait_for(lambda: first.deployments()["tiny"]["instances"]["READY"] == 1, ENGINE_START, "READY")
    [engine] = first.engine_pids().values()

    # The waiting runtime: the engine may have been one (it keeps the runtime's command line).
    def runtimes() -> set[int]:
        children = psutil.Process(first.proc.pid).children()
        return {c.pid for c in children if "runtime" in c.cmdline()} - {engine}

    first.wait_for(lambda: len(runtimes()) == 1, ENGINE_START, "a warm runtime")
    [runtime] = runtimes()

    second = subprocess.run(
        [STOKER, "up", "--port", str(free_port())], env=first.env, capture_output=True, text=True, timeout=CLI
    )
    assert_one_line_error(second, f"is in use by another Stoker platform (pid {first.proc.pid})")
    assert pid_alive(engine) and pid_alive(runtime)
    assert _chat(first.url, 2)["completion_tokens"] >= 1
    assert first.engine_pids() == {next(iter(first.engine_pids())): engine}
